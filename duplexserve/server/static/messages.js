// What the page says when the server refuses or ends a session: a sentence for each error
// code (docs/protocol.md lists them), instead of the code itself. A code not here shows the
// server's own message, with the code after it for a bug report.

const SENTENCES = {
  server_unavailable: "The server is busy: every session it can hold is taken. Try again in a moment.",
  server_shutdown: "The server is shutting down. Try again in a moment.",
  too_many_sessions: "This computer already holds as many sessions as the server allows. End one first.",
  invalid_api_key: "This server needs an API key: open the page as /?token=YOUR_KEY.",
  unauthorized: "This server needs an API key: open the page as /?token=YOUR_KEY.",
  origin_not_allowed: "This server does not take sessions from this page's address (its --allowed-origins).",
  voice_not_found: "The server has no such voice: choose one from the list.",
  invalid_prompt: (message) => `The model cannot take this persona: ${message}.`,
  prompt_unsupported: "This model takes no persona: the conversation goes on without it.",
  session_locked: "The persona is set once, before the conversation starts: start again to change it.",
  engine_error: "The model failed and the session ended. Try again.",
  idle_timeout: "The session ended: the server heard nothing for too long.",
  max_duration: "The session reached the server's time limit.",
  slow_consumer: "The page fell behind playing the answer, and the server ended the session.",
  unsupported_format: "The server cannot take this page's audio format.",
};

export function humanize(code, message) {
  const sentence = SENTENCES[code];
  if (typeof sentence === "function") return sentence(message);
  if (sentence) return sentence;
  return message ? `${message} (${code})` : String(code);
}
