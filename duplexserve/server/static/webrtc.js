// The talk page's WebRTC path: the microphone as an Opus track, the model's voice as the
// remote track, OpenAI Realtime events on the "oai-events" data channel; the offer goes to
// POST /v1/realtime/calls as OpenAI's browser clients send it. Over UDP a lost packet is
// concealed instead of stalling the conversation as it does over TCP.

import { humanize } from "./messages.js";

const CHANNEL = "oai-events";

// The server said no (auth, capacity, drain): the WebSocket would be refused too.
export class CallRefused extends Error {}

// Every remote stream is also attached to a muted <audio> element: Chrome feeds a remote
// WebRTC stream to Web Audio only while a media element plays it.
const sinks = new Set();

// The STUN servers the server names (behind TURN it needs this browser's reflexive address);
// none from a server that names none, or predates the route. With keys it needs the page's.
async function iceServers(token) {
  try {
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const response = await fetch(new URL("v1/realtime/ice_servers", document.baseURI), { headers });
    if (response.ok) return (await response.json()).ice_servers || [];
  } catch (_err) {
    // no such route: host candidates only
  }
  return [];
}

function gathered(pc, timeoutMs) {
  // No trickle ICE on the server: the offer carries its candidates.
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (pc.iceGatheringState === "complete") resolve();
    };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, timeoutMs);
  });
}

function refusal(status, body) {
  let code = String(status);
  let message = body.slice(0, 200);
  try {
    const error = JSON.parse(body).error;
    code = error.code;
    message = error.message;
  } catch (_err) {
    // not JSON: the status says enough
  }
  // 501: no WebRTC on this server, 404/405: an older server; anything else is its answer.
  if ([501, 404, 405].includes(status)) return new Error(`${code}: ${message}`);
  return new CallRefused(humanize(code, message));
}

// Opens a call; resolves once session.created came on the data channel, with
// { pc, channel, remote (MediaStream), location }. onEvent gets every Realtime event; onEnd is
// called when the call goes without the page ending it (the server closed the channel, ICE failed).
// ``session`` (a Realtime session object, the persona) goes with the offer, as OpenAI's
// multipart form: the server runs its prompt before the call's first audio.
export async function openCall({ mic, token, session, onEvent, onEnd, timeoutMs }) {
  const pc = new RTCPeerConnection({ iceServers: await iceServers(token) });
  const call = { pc, channel: null, remote: null, location: null };
  let timer = null;
  try {
    for (const track of mic.getAudioTracks()) pc.addTrack(track, mic);
    const channel = pc.createDataChannel(CHANNEL);
    call.channel = channel;
    let created;
    const ready = new Promise((resolve, reject) => {
      created = resolve;
      timer = setTimeout(() => reject(new Error(`no session after ${timeoutMs} ms (ICE did not connect)`)),
        timeoutMs);
      pc.addEventListener("connectionstatechange", () => {
        if (pc.connectionState === "failed") reject(new Error("ICE failed"));
        if (["failed", "closed"].includes(pc.connectionState)) onEnd();
      });
    });
    channel.addEventListener("close", () => onEnd());
    ready.catch(() => {}); // a call given up before it is awaited (refused, the WebSocket instead)
    channel.onmessage = (event) => {
      let msg;
      try {
        msg = JSON.parse(event.data);
      } catch (_err) {
        return;
      }
      if (msg.type === "session.created") created();
      onEvent(msg);
    };
    pc.ontrack = (event) => {
      call.remote = event.streams[0] || new MediaStream([event.track]);
      const sink = new Audio();
      sink.muted = true;
      sink.srcObject = call.remote;
      sinks.add(sink);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc, 2000);
    const headers = {};
    if (token) headers.Authorization = `Bearer ${token}`;
    let body = pc.localDescription.sdp;
    if (session) {
      body = new FormData();
      body.set("sdp", pc.localDescription.sdp);
      body.set("session", JSON.stringify(session));
    } else {
      headers["Content-Type"] = "application/sdp";
    }
    const response = await fetch(new URL("v1/realtime/calls", document.baseURI), {
      method: "POST",
      body,
      headers,
    });
    const answer = await response.text();
    if (response.status !== 201) throw refusal(response.status, answer);
    call.location = response.headers.get("Location");
    await pc.setRemoteDescription({ type: "answer", sdp: answer });
    await ready;
    if (!call.remote) throw new Error("the answer has no audio track");
    return call;
  } catch (err) {
    closeCall(call);
    throw err;
  } finally {
    clearTimeout(timer);
  }
}

export function closeCall(call) {
  if (!call) return;
  if (call.channel && call.channel.readyState === "open") call.channel.close();
  call.pc.close();
  for (const sink of sinks) sink.srcObject = null;
  sinks.clear();
}

// What the browser says of the call: the selected ICE pair, its round trip, and what
// its own jitter buffer did with the model's audio.
export async function callFigures(pc) {
  const report = await pc.getStats();
  const figures = {};
  let pairId = null;
  report.forEach((s) => {
    if (s.type === "transport" && s.selectedCandidatePairId) pairId = s.selectedCandidatePairId;
  });
  report.forEach((s) => {
    if (s.type === "candidate-pair" && (s.id === pairId || (!pairId && s.nominated && s.state === "succeeded"))) {
      const local = report.get(s.localCandidateId);
      const remote = report.get(s.remoteCandidateId);
      if (s.currentRoundTripTime !== undefined) figures.rttMs = s.currentRoundTripTime * 1000;
      if (local) figures.iceLocal = `${local.address}:${local.port}`;
      if (remote) figures.iceRemote = `${remote.address}:${remote.port}`;
    } else if (s.type === "inbound-rtp" && s.kind === "audio") {
      if (s.jitterBufferEmittedCount) {
        figures.bufferMs = (1000 * s.jitterBufferDelay) / s.jitterBufferEmittedCount;
      }
      figures.concealmentEvents = s.concealmentEvents || 0;
      figures.packetsReceived = s.packetsReceived || 0;
      figures.packetsLost = s.packetsLost || 0;
    } else if (s.type === "outbound-rtp" && s.kind === "audio") {
      figures.packetsSent = s.packetsSent || 0;
    }
  });
  return figures;
}
