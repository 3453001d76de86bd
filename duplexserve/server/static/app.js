// The talk page: microphone -> 80 ms pcm_f32le frames over duplex/1 -> jitter buffer -> speaker.
// No build step: a plain ES module served as a static file next to index.html.

const RATE = 24000;
const FRAME_SAMPLES = 1920;
const FRAME_MS = 80;
const RTT_WINDOW = 64; // round trips kept for the median
const SENT_RING = 4096; // send times by frame index, for the round trip of frame i

const $ = (id) => document.getElementById(id);

// Everything the page shows, also read by the browser test.
const stats = {
  state: "idle",
  sessionId: null,
  engine: null,
  model: null,
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
};
window.duplexStats = stats;

let ctx = null;
let ws = null;
let mic = null;
let capture = null;
let player = null;
let sentAt = new Float64Array(SENT_RING);
let rtts = [];

function socketUrl() {
  const url = new URL("v1/duplex", document.baseURI);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("input_format", "pcm_f32le");
  url.searchParams.set("output_format", "pcm_f32le");
  const token = new URLSearchParams(location.search).get("token");
  if (token) url.searchParams.set("token", token);
  return url.toString();
}

function setState(state) {
  stats.state = state;
  document.body.dataset.state = state;
  const button = $("talk");
  button.disabled = state === "connecting" || state === "ending";
  button.textContent = state === "live" ? "Stop" : state === "idle" ? "Start talking" : "…";
  button.classList.toggle("live", state === "live");
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
  });
  $("transcript").textContent = "";
  rtts = [];
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
    capture = new AudioWorkletNode(ctx, "capture", { numberOfInputs: 1, numberOfOutputs: 1 });
    capture.port.onmessage = (event) => sendFrame(event.data);
    // The capture node outputs silence; connecting it keeps it pulled by the audio graph.
    ctx.createMediaStreamSource(mic).connect(capture).connect(ctx.destination);
    await ctx.resume();
    setState("live");
  } catch (err) {
    showError(String(err.message || err));
    teardown();
  }
}

function prebufferSamples() {
  return Math.round((Number($("prebuffer").value) / 1000) * RATE);
}

function openSocket() {
  return new Promise((resolve, reject) => {
    ws = new WebSocket(socketUrl());
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
      } else if (msg.type === "text.delta") {
        stats.textDeltas += 1;
        stats.text += msg.text;
        $("transcript").textContent = stats.text;
        $("transcript").scrollTop = $("transcript").scrollHeight;
      } else if (msg.type === "error") {
        showError(`${msg.code}: ${msg.message}`);
      } else if (msg.type === "session.closed") {
        stats.closeReason = msg.reason;
      }
    };
    ws.onclose = (event) => {
      if (!created) {
        explainRefusal(event.code).then((why) => reject(new Error(why)));
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
    if (ready.draining) return "the server is draining, try again later";
    if (!ready.ready) return "the server is full, try again later";
  } catch (_err) {
    return "cannot reach the server";
  }
  return `the server refused the session (close ${code})`;
}

function sendFrame({ frame, peak }) {
  stats.inputPeak = peak;
  if (!ws || ws.readyState !== WebSocket.OPEN || stats.state !== "live") return;
  sentAt[stats.framesSent % SENT_RING] = performance.now();
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
function stop() {
  setState("ending");
  if (capture) capture.disconnect();
  if (mic) mic.getTracks().forEach((t) => t.stop());
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "input.end" }));
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
  if (ctx) ctx.close();
  ctx = ws = mic = capture = player = null;
  stats.inputPeak = stats.outputPeak = 0;
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
  $("session").textContent = stats.sessionId
    ? `${stats.sessionId} · ${stats.engine} · ${stats.model}`
    : "no session";
  $("closed").textContent = stats.closeReason ? `last session: ${stats.closeReason}` : "";
  shownIn = Math.max(stats.inputPeak, shownIn * 0.92);
  shownOut = Math.max(stats.outputPeak, shownOut * 0.92);
  $("mic-level").style.width = `${meterPercent(shownIn)}%`;
  $("model-level").style.width = `${meterPercent(shownOut)}%`;
  requestAnimationFrame(render);
}

$("talk").addEventListener("click", () => (stats.state === "live" ? stop() : start()));
$("prebuffer").addEventListener("change", () => {
  if (player) player.port.postMessage({ prebuffer: prebufferSamples() });
});
setState("idle");
requestAnimationFrame(render);
