// Ferry's console: live updates over Server-Sent Events. Everything from the stream is
// written as text (textContent), never as markup.
"use strict";

// The board is read again (as a fragment) whenever the tenant's stream moves.
function liveBoard(board) {
  const source = new EventSource("/console/changes");
  // Said on the page once the stream is open: what happens from then on is shown.
  source.onopen = () => { board.dataset.connected = "yes"; };
  let pending = null;
  source.onmessage = () => {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      const response = await fetch(board.dataset.live, { credentials: "same-origin" });
      if (response.ok) {
        // The fragment is Ferry's own escaped markup; it is parsed, not evaluated.
        const parsed = new DOMParser().parseFromString(await response.text(), "text/html");
        board.replaceChildren(...parsed.body.childNodes);
      }
    }, 300);
  };
}

function liveEvents(tbody) {
  const filter = document.getElementById("type-filter");
  const rows = [];
  const show = (row) => {
    const needle = (filter.value || "").toLowerCase();
    row.hidden = needle !== "" && !row.dataset.type.toLowerCase().includes(needle);
  };
  filter.addEventListener("input", () => rows.forEach(show));
  const source = new EventSource(tbody.dataset.stream);
  source.onopen = () => { tbody.dataset.connected = "yes"; };
  const add = (message) => {
    let event;
    try { event = JSON.parse(message.data); } catch { return; }
    const row = document.createElement("tr");
    row.dataset.type = String(event.type || "");
    for (const text of [event.time, event.type, event.subject, event.actor || (event.data && event.data.actor)]) {
      const cell = document.createElement("td");
      cell.textContent = text == null ? "" : String(text);
      row.appendChild(cell);
    }
    show(row);
    tbody.prepend(row);
    rows.unshift(row);
    // The newest 500 stay on the page.
    while (rows.length > 500) rows.pop().remove();
  };
  source.onmessage = add;
}

document.addEventListener("DOMContentLoaded", () => {
  const board = document.querySelector("[data-live]");
  if (board) liveBoard(board);
  const events = document.querySelector("tbody[data-stream]");
  if (events) liveEvents(events);
});
