// The dashboard's pages: confirmations before actions, and live lists that replace their rows
// with what the server sends (server-sent events) without reloading the page.
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
  });
  events.addEventListener("signed-out", () => {
    events.close();
    window.location.assign("/dashboard/sign-in");
  });
  events.addEventListener("refused", () => events.close());
}
