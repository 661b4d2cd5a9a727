// A sandbox's shell in the page: xterm.js on a WebSocket to the node (dashboard/terminal.py).
// Keys and pastes go out as bytes, sizes as JSON; a dropped connection comes back to the same
// shell (by its pid) after a second, or at once with the Reconnect button.
"use strict";

// xterm.js draws with <style> elements it makes: each gets the page's CSP nonce as it is made
// (before it is inserted, or the browser ignores its rules).
const styleNonce = document.querySelector('meta[name="style-nonce"]').content;
const createElement = Document.prototype.createElement;
Document.prototype.createElement = function (name, options) {
  const element = createElement.call(this, name, options);
  if (String(name).toLowerCase() === "style") {
    element.setAttribute("nonce", styleNonce);
  }
  return element;
};

window.addEventListener("DOMContentLoaded", () => {
  const element = document.getElementById("terminal");
  const status = document.getElementById("terminal-status");
  const term = new window.Terminal({ cursorBlink: true, convertEol: false });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(element);
  fit.fit();
  const encoder = new TextEncoder();
  let socket = null;
  let pid = null;
  let ended = false;

  function connect() {
    const query = new URLSearchParams({ cols: term.cols, rows: term.rows });
    if (pid !== null) {
      query.set("pid", pid);
    }
    const scheme = window.location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${window.location.host}${element.dataset.socket}?${query}`);
    const mine = socket;
    socket.binaryType = "arraybuffer";
    socket.addEventListener("message", (event) => {
      if (typeof event.data !== "string") {
        term.write(new Uint8Array(event.data));
        return;
      }
      const message = JSON.parse(event.data);
      if (message.type === "started") {
        pid = message.pid;
        status.textContent = "connected";
        term.focus();
      } else if (message.type === "exit") {
        pid = null;
        ended = true;
        status.textContent = `the shell exited (${message.code})`;
      } else if (message.type === "error") {
        pid = null; // that shell is gone: the next connection starts another
        status.textContent = message.message;
      }
    });
    socket.addEventListener("close", (event) => {
      if (mine !== socket) {
        return; // replaced by the Reconnect button
      }
      if (ended || event.code >= 4000) {
        status.textContent = event.reason || status.textContent;
        return;
      }
      status.textContent = "disconnected: reconnecting…";
      window.setTimeout(connect, 1000);
    });
  }

  term.onData((data) => {
    if (socket && socket.readyState === WebSocket.OPEN) {
      socket.send(encoder.encode(data));
    }
  });
  term.onResize(({ cols, rows }) => {
    if (socket && socket.readyState === WebSocket.OPEN) {
      socket.send(JSON.stringify({ type: "resize", cols, rows }));
    }
  });
  window.addEventListener("resize", () => fit.fit());
  document.getElementById("terminal-reconnect").addEventListener("click", () => {
    ended = false;
    // Until the new connection's shell answers: keys typed meanwhile would be dropped.
    status.textContent = "connecting…";
    if (socket && socket.readyState === WebSocket.OPEN) {
      socket.close(4000, "reconnect"); // keeps the shell: the server kills it on 1000/1001 only
    }
    connect();
  });
  connect();
});
