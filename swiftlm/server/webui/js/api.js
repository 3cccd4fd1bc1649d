// Calls to this server's API: the key header, error messages in OpenAI's shape, and the
// streamed chat completion read as server-sent events.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let apiKey = "";

export function setApiKey(key) {
  apiKey = (key || "").trim();
}

function headers(extra = {}) {
  const h = { ...extra };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function errorOf(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(resp.status, message);
}

async function getJson(path) {
  const resp = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!resp.ok) throw await errorOf(resp);
  return resp.json();
}

export const listModels = () => getJson("v1/models");
export const pageInfo = () => getJson("webui/info");

// One SSE event block ("data: ..." lines, blank-line terminated) -> its data, or null.
function dataOf(block) {
  const lines = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith("data:")) lines.push(line.slice(line.startsWith("data: ") ? 6 : 5));
  }
  return lines.length ? lines.join("\n") : null;
}

// POST /v1/chat/completions with stream:true and hand each parsed chunk to onChunk.
// Resolves when the stream ends ([DONE] or the connection closes); rejects with ApiError on an
// HTTP or in-stream error, and with an AbortError when `signal` aborts.
export async function streamChat(body, signal, onChunk) {
  const resp = await fetch("v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify(body),
    signal,
  });
  if (!resp.ok) throw await errorOf(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value;
    let m;
    while ((m = /\r?\n\r?\n/.exec(buf))) {
      const data = dataOf(buf.slice(0, m.index));
      buf = buf.slice(m.index + m[0].length);
      if (data === null) continue;
      if (data === "[DONE]") return;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch {
        continue; // not ours to judge: skip a malformed frame
      }
      if (chunk.error) throw new ApiError(500, chunk.error.message || "generation failed");
      onChunk(chunk);
    }
  }
}
