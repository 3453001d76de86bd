// The talk page: microphone -> model -> speaker, both ways at once. Over WebRTC (the
// default where it connects, webrtc.js): Opus tracks and Realtime events on a data channel.
// Otherwise over the WebSocket: 80 ms pcm_f32le frames over duplex/1 -> jitter buffer -> speaker.
// A model that takes a persona (PersonaPlex) lists its voices at GET /v1/voices: the page then
// offers them and a text prompt, sent as the native query's text_prompt and voice_prompt, or
// as the call's Realtime session (instructions, output voice).
// No build step: plain ES modules served as static files next to index.html.

import { humanize } from "./messages.js";
import { CallRefused, callFigures, closeCall, openCall } from "./webrtc.js";

const RATE = 24000;
const FRAME_SAMPLES = 1920;
const FRAME_MS = 80;
const RTT_WINDOW = 64; // round trips kept for the median
const SENT_RING = 4096; // send times by frame index, for the round trip of frame i
const CALL_TIMEOUT_MS = 6000; // WebRTC not connected by then: the WebSocket instead
const RECORD_FRAMES = 400; // 32 s of what was sent and heard (WebRTC), for the browser test

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const token = params.get("token");

// What the round trip means differs by transport, and its label says which.
const RTT_LABELS = {
  websocket: ["frame to its answer, ms", "median frame to answer, ms",
    "From sending an 80 ms frame to receiving the model's answer to it: the network both ways " +
    "and the server's turnaround (the model's step included)."],
  webrtc: ["network round trip, ms", "median network round trip, ms",
    "The WebRTC connection's own round trip (ICE): the network alone, not the model's turnaround."],
};

// Everything the page shows, also read by the browser test.
const stats = {
  state: "idle",
  sessionId: null,
  engine: null, // the server's engine (GET /ready), whatever the transport
  model: null, // the model it serves (GET /v1/models), then the session's own name for it
  framesSent: 0,
  framesReceived: 0,
  textDeltas: 0,
  text: "",
  rttMs: null,
  rttP50Ms: null,
  bufferMs: 0,
  underruns: 0,
  droppedMs: 0,
  inputPeak: 0,
  outputPeak: 0,
  maxOutputPeak: 0,
  closeReason: null,
  error: null,
  transport: null, // "webrtc" or "websocket" once connected
  iceLocal: null,
  iceRemote: null,
};
window.duplexStats = stats;

// WebRTC: the microphone as sent and the model as heard, 24 kHz, on one clock (both are
// captured by the same audio graph), so a test can line them up.
const recording = { sent: [], heard: [] };
function keep(list, frame) {
  list.push(frame.slice());
  if (list.length > RECORD_FRAMES) list.shift();
}
function base64(frames) {
  const all = new Float32Array(frames.length * FRAME_SAMPLES);
  frames.forEach((f, i) => all.set(f, i * FRAME_SAMPLES));
  const bytes = new Uint8Array(all.buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}
window.duplexRecording = () => ({ rate: RATE, sent: base64(recording.sent), heard: base64(recording.heard) });

let ctx = null;
let ws = null;
let mic = null;
let capture = null;
let player = null;
let sentAt = new Float64Array(SENT_RING);
// The last frames sent (by input index): after a move the server asks again from its frames_in.
let sentFrames = new Array(SENT_RING);
let moved = null; // session.moved: where the session went, its token (docs/protocol.md)
let rtts = [];
let call = null; // WebRTC: { pc, channel, remote, location }
let heard = null; // WebRTC: the capture node on the model's voice
let figuresTimer = null;

function socketUrl() {
  const url = new URL("v1/duplex", document.baseURI);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("input_format", "pcm_f32le");
  url.searchParams.set("output_format", "pcm_f32le");
  if (token) url.searchParams.set("token", token);
  const { text, voice } = persona();
  if (text) url.searchParams.set("text_prompt", text);
  if (voice) url.searchParams.set("voice_prompt", voice);
  return url.toString();
}

// The persona chosen: nothing where the model takes none (the controls stay hidden).
function persona() {
  if ($("persona").hidden) return { text: "", voice: "" };
  return { text: $("prompt").value.trim(), voice: $("voice").value };
}

// The call's Realtime session: the same persona as instructions and the output voice.
function callSession() {
  const { text, voice } = persona();
  if (!text && !voice) return null;
  const session = { type: "realtime" };
  if (text) session.instructions = text;
  if (voice) session.audio = { output: { voice } };
  return session;
}

// A voice's name as a person reads it: PersonaPlex's NATF2.pt is "Natural female 2", a
// file of one's own "my voice"; the file's kind is said only where two share a name.
const VOICE_KINDS = { NAT: "Natural", VAR: "Variety" };
function voiceStem(id) {
  return id.replace(/\.[A-Za-z0-9]+$/, "");
}
function voiceLabel(id, ids) {
  const stem = voiceStem(id);
  const persona = /^(NAT|VAR)([FM])(\d+)$/.exec(stem);
  const name = persona
    ? `${VOICE_KINDS[persona[1]]} ${persona[2] === "F" ? "female" : "male"} ${persona[3]}`
    : stem.replace(/[-_]+/g, " ").trim() || id;
  const twins = ids.filter((other) => voiceStem(other) === stem).length > 1;
  return twins ? `${name} (${id.slice(stem.length + 1)})` : name;
}

// The voices the server holds; a model without prompts lists none, and the page offers none.
async function loadVoices() {
  const url = new URL("v1/voices", document.baseURI);
  if (token) url.searchParams.set("token", token);
  try {
    const response = await fetch(url);
    if (!response.ok) return;
    const voices = (await response.json()).data || [];
    const ids = voices.map((v) => v.id);
    for (const id of ids) $("voice").add(new Option(voiceLabel(id, ids), id));
    const asked = params.get("voice"); // ?voice=NATF2.pt
    if (voices.some((v) => v.id === asked)) $("voice").value = asked;
    $("prompt").value = params.get("prompt") || "";
    $("persona").hidden = voices.length === 0;
  } catch (_err) {
    // no voices route: no persona to choose
  }
}

// What the server serves, shown from the start: its model (GET /v1/models) and engine (GET /ready).
async function loadServed() {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  try {
    const models = await fetch(new URL("v1/models", document.baseURI), { headers });
    if (models.ok) stats.model = ((await models.json()).data || [])[0]?.id || stats.model;
  } catch (_err) {
    // an older server: the model is named once a session starts
  }
  try {
    const ready = await fetch(new URL("ready", document.baseURI));
    stats.engine = (await ready.json()).engine || stats.engine;
  } catch (_err) {
    // not reachable now: the session says
  }
}

// The WebSocket's jitter buffer is the page's; over WebRTC the browser has its own.
function syncControls() {
  const overWebRTC = stats.transport === "webrtc" && stats.state !== "idle";
  $("prebuffer").disabled = $("transport").value === "webrtc" || overWebRTC;
}

function showRttLabels(transport) {
  const [now, median, title] = RTT_LABELS[transport] || ["round trip, ms", "median round trip, ms", ""];
  $("rtt-label").textContent = now;
  $("rtt-p50-label").textContent = median;
  $("rtt-label").title = $("rtt-p50-label").title = title;
}

function setState(state) {
  stats.state = state;
  document.body.dataset.state = state;
  const button = $("talk");
  button.disabled = state === "connecting" || state === "ending";
  button.textContent = state === "live" ? "Stop" : state === "idle" ? "Start talking" : "…";
  button.classList.toggle("live", state === "live");
  syncControls();
}

function showError(message) {
  stats.error = message || null;
  $("error").textContent = message;
  $("error").hidden = !message;
}

function median(values) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[sorted.length >> 1];
}

async function start() {
  showError("");
  Object.assign(stats, {
    sessionId: null, framesSent: 0, framesReceived: 0, textDeltas: 0, text: "", rttMs: null,
    rttP50Ms: null, bufferMs: 0, underruns: 0, droppedMs: 0, maxOutputPeak: 0, closeReason: null,
    transport: null, iceLocal: null, iceRemote: null,
  });
  $("transcript").textContent = "";
  rtts = [];
  recording.sent = [];
  recording.heard = [];
  sentAt = new Float64Array(SENT_RING);
  setState("connecting");
  try {
    if (!navigator.mediaDevices) {
      throw new Error("the microphone needs a secure page: open it over https or on localhost");
    }
    // A 24 kHz context: the browser resamples the microphone, the page speaks the model's rate.
    ctx = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
    await ctx.audioWorklet.addModule(new URL("worklet.js", import.meta.url));
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    const mode = $("transport").value;
    $("persona").querySelectorAll("select, textarea").forEach((e) => (e.disabled = true));
    if (mode !== "websocket" && window.RTCPeerConnection) {
      try {
        await startCall();
        return;
      } catch (err) {
        if (mode === "webrtc" || err instanceof CallRefused) throw err;
        closeCall(call);
        call = null;
        console.info(`WebRTC did not connect (${err.message}): the WebSocket instead`);
      }
    }
    await startSocket();
  } catch (err) {
    showError(String(err.message || err));
    teardown();
  }
}

// WebRTC: the call carries the microphone and the model's voice; the page only listens in.
async function startCall() {
  call = await openCall({
    mic, token, session: callSession(), onEvent: realtimeEvent, onEnd: callEnded, timeoutMs: CALL_TIMEOUT_MS,
  });
  stats.transport = "webrtc";
  showRttLabels("webrtc");
  const voice = ctx.createMediaStreamSource(call.remote);
  voice.connect(ctx.destination);
  // Two capture nodes made together: the microphone and the voice on one frame clock.
  capture = new AudioWorkletNode(ctx, "capture", { numberOfInputs: 1, numberOfOutputs: 1 });
  heard = new AudioWorkletNode(ctx, "capture", { numberOfInputs: 1, numberOfOutputs: 1 });
  capture.port.onmessage = (event) => micFrame(event.data);
  heard.port.onmessage = (event) => heardFrame(event.data);
  ctx.createMediaStreamSource(mic).connect(capture).connect(ctx.destination);
  voice.connect(heard).connect(ctx.destination);
  figuresTimer = setInterval(readFigures, 500);
  await ctx.resume();
  setState("live");
}

function realtimeEvent(msg) {
  if (msg.type === "session.created") {
    Object.assign(stats, { sessionId: msg.session.id, model: msg.session.model });
  } else if (msg.type === "response.output_audio_transcript.delta") {
    addText(msg.delta);
  } else if (msg.type === "error") {
    showError(humanize(msg.error.code, msg.error.message));
  } else if (msg.type === "session.closed") {
    stats.closeReason = msg.reason;
    callEnded();
  }
}

// The server ended the call's session (session.closed), or the call itself went (the data
// channel closed, ICE failed): the page goes back to idle, saying why.
function callEnded() {
  if (!call || stats.state === "idle") return;
  if (!stats.closeReason) stats.closeReason = "disconnected";
  teardown();
}

function micFrame({ frame, peak }) {
  stats.inputPeak = peak;
  if (stats.state !== "live") return;
  stats.framesSent += 1;
  keep(recording.sent, frame);
}

function heardFrame({ frame, peak }) {
  stats.framesReceived += 1;
  stats.outputPeak = peak;
  if (peak > stats.maxOutputPeak) stats.maxOutputPeak = peak;
  keep(recording.heard, frame);
}

async function readFigures() {
  if (!call) return;
  const f = await callFigures(call.pc);
  if (f.rttMs !== undefined) {
    stats.rttMs = f.rttMs;
    rtts.push(f.rttMs);
    if (rtts.length > RTT_WINDOW) rtts.shift();
    stats.rttP50Ms = median(rtts);
  }
  if (f.bufferMs !== undefined) stats.bufferMs = f.bufferMs;
  if (f.concealmentEvents !== undefined) stats.underruns = f.concealmentEvents;
  stats.iceLocal = f.iceLocal || stats.iceLocal;
  stats.iceRemote = f.iceRemote || stats.iceRemote;
}

function addText(text) {
  stats.textDeltas += 1;
  stats.text += text;
  $("transcript").textContent = stats.text;
  $("transcript").scrollTop = $("transcript").scrollHeight;
}

// The WebSocket: 80 ms frames of pcm_f32le both ways, played through the page's own jitter buffer.
async function startSocket() {
  player = new AudioWorkletNode(ctx, "playback", {
    numberOfInputs: 0,
    outputChannelCount: [1],
    processorOptions: { prebuffer: prebufferSamples() },
  });
  player.port.onmessage = (event) => {
    const m = event.data;
    stats.bufferMs = (m.depth / RATE) * 1000;
    stats.underruns = m.underruns;
    stats.droppedMs = (m.dropped / RATE) * 1000;
  };
  player.connect(ctx.destination);
  await openSocket();
  stats.transport = "websocket";
  showRttLabels("websocket");
  capture = new AudioWorkletNode(ctx, "capture", { numberOfInputs: 1, numberOfOutputs: 1 });
  capture.port.onmessage = (event) => sendFrame(event.data);
  // The capture node outputs silence; connecting it keeps it pulled by the audio graph.
  ctx.createMediaStreamSource(mic).connect(capture).connect(ctx.destination);
  await ctx.resume();
  setState("live");
}

function prebufferSamples() {
  return Math.round((Number($("prebuffer").value) / 1000) * RATE);
}

// After session.moved and its close 1012: resume at the same address with the token it gave,
// from the last frame heard; any replica relays it to the one that now holds the session.
function resumeUrl(resumeToken) {
  const url = new URL(socketUrl());
  url.searchParams.delete("text_prompt");
  url.searchParams.delete("voice_prompt");
  url.searchParams.set("resume", resumeToken);
  url.searchParams.set("last_frame", String(stats.framesReceived - 1));
  return url.toString();
}

// Send again what the server did not take before the move (frames_in on), where still kept.
function resendFrom(framesIn) {
  for (let i = framesIn; i < stats.framesSent; i += 1) {
    if (stats.framesSent - i < SENT_RING) ws.send(sentFrames[i % SENT_RING]);
  }
}

function openSocket(address) {
  return new Promise((resolve, reject) => {
    ws = new WebSocket(address || socketUrl());
    ws.binaryType = "arraybuffer";
    let created = false;
    ws.onmessage = (event) => {
      if (typeof event.data !== "string") {
        receiveFrame(event.data);
        return;
      }
      const msg = JSON.parse(event.data);
      if (msg.type === "session.created") {
        created = true;
        Object.assign(stats, { sessionId: msg.session_id, engine: msg.engine, model: msg.model });
        resolve();
      } else if (msg.type === "session.resumed") {
        created = true;
        resendFrom(msg.frames_in);
        resolve();
      } else if (msg.type === "session.moved") {
        moved = msg;
      } else if (msg.type === "text.delta") {
        addText(msg.text);
      } else if (msg.type === "error") {
        showError(humanize(msg.code, msg.message));
      } else if (msg.type === "session.closed") {
        stats.closeReason = msg.reason;
      }
    };
    ws.onclose = (event) => {
      if (!created) {
        explainRefusal(event.code).then((why) => reject(new Error(why)));
        return;
      }
      if (event.code === 1012 && moved) {  // the session moved to another replica: follow it
        const resumeToken = moved.resume.token;
        moved = null;
        openSocket(resumeUrl(resumeToken)).catch((err) => {
          stats.closeReason = `moved; ${err.message}`;
          finish();
        });
        return;
      }
      if (!stats.closeReason) stats.closeReason = `closed ${event.code}`;
      finish();
    };
    // A failed connection fires error, then close: the close handler says why.
  });
}

// A refused upgrade (HTTP 503 when the server runs with refuse_with_http_503) reaches a
// page only as close 1006, without the reason: ask /ready for it.
async function explainRefusal(code) {
  if (stats.error) return stats.error;
  try {
    const ready = await (await fetch(new URL("ready", document.baseURI))).json();
    if (ready.draining) return humanize("server_shutdown");
    if (!ready.ready) return humanize("server_unavailable");
  } catch (_err) {
    return "The server cannot be reached.";
  }
  return `The server refused the session (close ${code}).`;
}

function sendFrame({ frame, peak }) {
  stats.inputPeak = peak;
  if (!ws || ws.readyState !== WebSocket.OPEN || stats.state !== "live") return;
  sentAt[stats.framesSent % SENT_RING] = performance.now();
  sentFrames[stats.framesSent % SENT_RING] = frame.buffer;
  stats.framesSent += 1;
  ws.send(frame.buffer);
}

function receiveFrame(buffer) {
  const now = performance.now();
  const frame = new Float32Array(buffer);
  const i = stats.framesReceived;
  stats.framesReceived += 1;
  if (i < stats.framesSent && stats.framesSent - i < SENT_RING) {
    stats.rttMs = now - sentAt[i % SENT_RING];
    rtts.push(stats.rttMs);
    if (rtts.length > RTT_WINDOW) rtts.shift();
    stats.rttP50Ms = median(rtts);
  }
  let peak = 0;
  for (let k = 0; k < frame.length; k++) {
    const a = Math.abs(frame[k]);
    if (a > peak) peak = a;
  }
  stats.outputPeak = peak;
  if (peak > stats.maxOutputPeak) stats.maxOutputPeak = peak;
  if (player) player.port.postMessage({ frame }, [frame.buffer]);
}

// Stop: no more microphone audio; the server answers every frame already sent, then closes.
// A call has no end of input: the page hears the answer's tail out, then hangs up.
function stop() {
  setState("ending");
  if (capture) capture.disconnect();
  if (mic) mic.getTracks().forEach((t) => t.stop());
  if (call) {
    setTimeout(() => {
      if (!stats.closeReason) stats.closeReason = "hung up";
      teardown();
    }, (stats.bufferMs || 0) + 4 * FRAME_MS);
  } else if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "input.end" }));
  else finish();
}

function finish() {
  if (player) player.port.postMessage({ ended: true });
  // Let the jitter buffer play out before the audio graph goes.
  const left = stats.bufferMs + 2 * FRAME_MS;
  setTimeout(teardown, left);
  setState("ending");
}

function teardown() {
  if (mic) mic.getTracks().forEach((t) => t.stop());
  if (ws && ws.readyState <= WebSocket.OPEN) ws.close();
  closeCall(call);
  clearInterval(figuresTimer);
  if (ctx) ctx.close();
  ctx = ws = mic = capture = player = call = heard = figuresTimer = null;
  stats.inputPeak = stats.outputPeak = 0;
  $("persona").querySelectorAll("select, textarea").forEach((e) => (e.disabled = false));
  setState("idle");
}

function fmt(value, digits = 0) {
  return value === null || value === undefined ? "–" : value.toFixed(digits);
}

// Peak meters on a 60 dB scale, falling back slowly so that speech reads as a level.
let shownIn = 0;
let shownOut = 0;
function meterPercent(peak) {
  const db = 20 * Math.log10(Math.max(peak, 1e-6));
  return Math.max(0, Math.min(100, ((db + 60) / 60) * 100));
}

function render() {
  $("rtt").textContent = fmt(stats.rttMs);
  $("rtt-p50").textContent = fmt(stats.rttP50Ms);
  $("buffer").textContent = fmt(stats.bufferMs);
  $("underruns").textContent = String(stats.underruns);
  $("sent").textContent = String(stats.framesSent);
  $("received").textContent = String(stats.framesReceived);
  $("tokens").textContent = String(stats.textDeltas);
  const served = [stats.model && `model ${stats.model}`, stats.engine && `engine ${stats.engine}`];
  $("served").textContent = served.filter(Boolean).join(" · ");
  $("session").textContent = stats.sessionId
    ? `session ${stats.sessionId} · engine ${stats.engine} · model ${stats.model}`
    : "no session";
  $("transport-used").textContent = stats.transport || "–";
  $("closed").textContent = stats.closeReason ? `last session: ${stats.closeReason}` : "";
  $("closed").hidden = !stats.closeReason;
  shownIn = Math.max(stats.inputPeak, shownIn * 0.92);
  shownOut = Math.max(stats.outputPeak, shownOut * 0.92);
  $("mic-level").style.width = `${meterPercent(shownIn)}%`;
  $("model-level").style.width = `${meterPercent(shownOut)}%`;
  requestAnimationFrame(render);
}

$("talk").addEventListener("click", () => (stats.state === "live" ? stop() : start()));
const asked = params.get("transport"); // ?transport=websocket
if (["auto", "webrtc", "websocket"].includes(asked)) $("transport").value = asked;
loadVoices();
loadServed();
$("transport").addEventListener("change", syncControls);
$("prebuffer").addEventListener("change", () => {
  if (player) player.port.postMessage({ prebuffer: prebufferSamples() });
});
setState("idle");
requestAnimationFrame(render);
