// AudioWorklet processors for the talk page: both run on the audio rendering thread,
// so neither capture nor playback depends on the main thread keeping up frame by frame.

const FRAME_SAMPLES = 1920; // 80 ms at 24 kHz, one model frame

// Microphone -> 80 ms frames. The context runs at 24 kHz, so the browser has already
// resampled the microphone: what is posted is pcm_f32le at the model's rate, sent as is.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frame = new Float32Array(FRAME_SAMPLES);
    this.fill = 0;
    this.peak = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    let offset = 0;
    while (offset < channel.length) {
      const n = Math.min(channel.length - offset, FRAME_SAMPLES - this.fill);
      this.frame.set(channel.subarray(offset, offset + n), this.fill);
      for (let i = offset; i < offset + n; i++) {
        const a = Math.abs(channel[i]);
        if (a > this.peak) this.peak = a;
      }
      this.fill += n;
      offset += n;
      if (this.fill === FRAME_SAMPLES) {
        // Transfer, not copy: the main thread hands this buffer straight to WebSocket.send.
        this.port.postMessage({ frame: this.frame, peak: this.peak }, [this.frame.buffer]);
        this.frame = new Float32Array(FRAME_SAMPLES);
        this.fill = 0;
        this.peak = 0;
      }
    }
    return true;
  }
}

// Model audio -> speaker, through a jitter buffer: playback starts once `prebuffer`
// samples are queued, an empty queue plays silence and counts an underrun (then
// buffers again), and a queue past `maxBuffer` drops its oldest audio to catch up.
class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = (options && options.processorOptions) || {};
    this.prebuffer = opts.prebuffer || 2 * FRAME_SAMPLES;
    this.maxBuffer = opts.maxBuffer || 12 * FRAME_SAMPLES;
    this.queue = [];
    this.head = 0; // read offset into queue[0]
    this.depth = 0; // samples queued
    this.playing = false;
    this.underruns = 0;
    this.dropped = 0;
    this.ended = false; // the session is over: running dry is then the end, not an underrun
    this.lastReport = 0;
    this.port.onmessage = (event) => {
      const msg = event.data;
      if (msg.frame) {
        this.queue.push(msg.frame);
        this.depth += msg.frame.length;
        while (this.depth > this.maxBuffer && this.queue.length > 1) {
          const old = this.queue.shift();
          this.depth -= old.length - this.head;
          this.dropped += old.length - this.head;
          this.head = 0;
        }
      } else if (msg.prebuffer) {
        this.prebuffer = msg.prebuffer;
      } else if (msg.ended) {
        this.ended = true;
        this.prebuffer = 1; // play out what is left
      }
    };
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.depth >= this.prebuffer) this.playing = true;
    let written = 0;
    if (this.playing) {
      while (written < out.length && this.queue.length) {
        const frame = this.queue[0];
        const n = Math.min(out.length - written, frame.length - this.head);
        out.set(frame.subarray(this.head, this.head + n), written);
        written += n;
        this.head += n;
        this.depth -= n;
        if (this.head === frame.length) {
          this.queue.shift();
          this.head = 0;
        }
      }
      if (written < out.length) {
        if (!this.ended) this.underruns += 1;
        this.playing = false;
      }
    }
    out.fill(0, written);
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (currentTime - this.lastReport >= 0.1) {
      this.lastReport = currentTime;
      this.port.postMessage({
        depth: this.depth,
        playing: this.playing,
        underruns: this.underruns,
        dropped: this.dropped,
      });
    }
    return true;
  }
}

registerProcessor("capture", CaptureProcessor);
registerProcessor("playback", PlaybackProcessor);
