// The dashboard's pages: confirmations before actions, live lists that replace their rows with
// what the server sends (server-sent events) without reloading the page, and build logs that
// grow as the build writes them.
"use strict";

document.addEventListener("submit", (event) => {
  const question = event.target.dataset.confirm;
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});

for (const list of document.querySelectorAll("[data-live]")) {
  const events = new EventSource(list.dataset.live);
  events.addEventListener("rows", (event) => {
    list.innerHTML = event.data;
    // For what draws into the part (charts.js): it was made anew.
    list.dispatchEvent(new Event("replaced"));
  });
  events.addEventListener("signed-out", () => {
    events.close();
    window.location.assign("/dashboard/sign-in");
  });
  events.addEventListener("refused", () => events.close());
}

for (const log of document.querySelectorAll("[data-follow]")) {
  const events = new EventSource(log.dataset.follow);
  const status = document.getElementById("build-status");
  const reason = document.getElementById("build-reason");
  events.addEventListener("lines", (event) => {
    log.insertAdjacentHTML("beforeend", event.data);
  });
  events.addEventListener("status", (event) => {
    status.textContent = event.data;
    status.className = `status status-${event.data}`;
  });
  events.addEventListener("reason", (event) => {
    reason.textContent = event.data;
  });
  events.addEventListener("complete", () => events.close());
  events.addEventListener("refused", () => events.close());
  events.addEventListener("signed-out", () => {
    events.close();
    window.location.assign("/dashboard/sign-in");
  });
}
