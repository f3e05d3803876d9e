// The gateway's HTTP API as the page uses it: JSON calls with the key, errors as ApiError
// (the OpenAI error object plus when to retry), and the SSE events of a streamed completion.

export class ApiError extends Error {
  constructor(status, body, retryAfterS) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "";
    this.param = error.param || "";
    this.retryAfterS = retryAfterS;   // null when the gateway gave no hint
  }
}

/** Seconds until a retry may succeed: retry-after-ms, else Retry-After (seconds), else null. */
function retryAfter(headers) {
  const ms = Number(headers.get("retry-after-ms"));
  if (ms > 0) return Math.ceil(ms / 1000);
  const s = Number(headers.get("retry-after"));
  return s > 0 ? Math.ceil(s) : null;
}

export class Api {
  constructor(key) { this.key = key; }

  async call(path, { method = "GET", body, signal } = {}) {
    const reply = await fetch(path, {
      method, signal, body: body === undefined ? undefined : JSON.stringify(body),
      headers: { "Authorization": `Bearer ${this.key}`, "Content-Type": "application/json" },
    });
    if (!reply.ok) {
      let parsed = null;
      try { parsed = await reply.json(); } catch (_) { /* not JSON */ }
      throw new ApiError(reply.status, parsed, retryAfter(reply.headers));
    }
    return reply;
  }

  async json(path, options) { return (await this.call(path, options)).json(); }
}

/** The JSON of each `data:` event of an SSE body until [DONE]; comments (keep-alives) are skipped. */
export async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

/** What a person should read for an error, and whether (and when) to retry. */
export function describeError(error, model) {
  if (!(error instanceof ApiError)) return { text: `Something went wrong: ${error.message}` };
  const retry = error.retryAfterS;
  switch (error.code) {
    case "rate_limit_exceeded":
      return { text: `Rate limited: ${error.message}`, retry: retry ?? 1 };
    case "context_length_exceeded":
      return { text: `Too long for the context of ${model}: ${error.message}. Start a new conversation or shorten the message.` };
    case "model_not_found":
      return { text: `The model ${model} is not available: ${error.message}. Choose another model.` };
    case "upstream_unavailable": case "overloaded": case "upstream_timeout":
      return { text: `The model ${model} is unavailable right now: ${error.message}`, retry };
    case "invalid_api_key":
      return { text: `The API key was refused: ${error.message}` };
    default:
      return { text: `Error ${error.status}: ${error.message}`, retry: error.status === 429 || error.status >= 500 ? retry : null };
  }
}
