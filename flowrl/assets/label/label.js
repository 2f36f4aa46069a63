// The labelling page: shows the pair the server names as current, sends each click, shows what it answered.
// The server is the only state: a reload, a restart or a second tab all read it again from there.
"use strict";

const token = new URLSearchParams(location.search).get("token");
let current = null;   // the pair on screen, as the server described it
let last = null;      // the last label in force (what undo withdraws), as the server described it
let busy = false;     // one request at a time: a second key press while saving is ignored, not queued

function withToken(url) {
  return token ? url + (url.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : url;
}

async function call(method, url, payload) {
  const headers = { "Accept": "application/json" };
  if (token) headers["X-FlowRL-Token"] = token;
  if (payload !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(url, { method, headers, body: payload === undefined ? undefined : JSON.stringify(payload) });
  } catch (e) {
    return { error: "the labelling server cannot be reached (was it stopped?); nothing was saved." };
  }
  try {
    return await response.json();
  } catch (e) {
    return { error: "the labelling server answered " + response.status + " " + response.statusText + "." };
  }
}

function show(answer) {
  const message = document.getElementById("message");
  message.textContent = answer.error || (answer.saved !== undefined ? "saved pair " + answer.saved
    : answer.undone !== undefined ? "undid pair " + answer.undone + "'s label" : "");
  message.className = answer.error ? "error" : "";
  if (!answer.progress) return;
  const p = answer.progress;
  last = p.last;
  document.getElementById("progress").textContent =
    p.labelled + " / " + p.total + " labelled (" + p.preferences + " preferences, " + p.ties + " ties, " + p.skips + " skips)";
  document.getElementById("btn-undo").disabled = !last;
  current = answer.current;
  document.getElementById("done").hidden = current !== null;
  document.getElementById("pair").hidden = current === null;
  document.getElementById("prompt").textContent = current ? "“" + current.prompt + "”  (pair " + current.pair + ")" : "";
  const missing = document.getElementById("missing");
  missing.hidden = !(current && current.missing.length);
  missing.textContent = current && current.missing.length
    ? "This pair cannot be compared: " + current.missing.join(", ") + " is missing from the pairs directory; skip it." : "";
  for (const choice of ["left", "right", "tie", "skip"]) {
    const compare = choice !== "skip";
    document.getElementById("btn-" + choice).disabled = !current || (compare && current.missing.length > 0);
  }
  for (const side of ["left", "right"]) {
    const img = document.getElementById(side);
    if (current) {
      img.src = withToken(current[side]);
      img.dataset.pair = current.pair;
    } else {
      img.removeAttribute("src");
    }
  }
  document.body.dataset.pair = current ? current.pair : "";
  document.body.dataset.ready = "1";
}

async function send(url, payload) {
  if (busy) return;
  busy = true;
  try {
    show(await call("POST", url, payload));
  } finally {
    busy = false;
  }
}

function choose(choice) {
  if (current && !document.getElementById("btn-" + choice).disabled) send("/api/label", { pair: current.pair, choice });
}

function undo() {
  if (last) send("/api/undo", { seq: last.seq });
}

const KEYS = { ArrowLeft: "left", "1": "left", ArrowRight: "right", "2": "right", t: "tie", "=": "tie", s: "skip" };

document.addEventListener("keydown", (event) => {
  if (event.ctrlKey || event.metaKey || event.altKey || event.repeat) return;
  if (event.key === "u" || event.key === "Backspace") {
    event.preventDefault();
    undo();
  } else if (KEYS[event.key]) {
    event.preventDefault();
    choose(KEYS[event.key]);
  }
});

for (const choice of ["left", "right", "tie", "skip"]) {
  document.getElementById("btn-" + choice).addEventListener("click", () => choose(choice));
}
document.getElementById("btn-undo").addEventListener("click", undo);
call("GET", "/api/state").then(show);
