// The public API as the page uses it: the key, JSON calls, and image requests and videos' events
// streamed as Server-Sent Events (read from fetch's body: EventSource cannot POST or send a key).

const KEY_ITEM = "gouache-api-key";

class ApiError extends Error {
  // The message of the API's error body ({"error": {"message", ...}}) and the HTTP status; 0
  // for a network failure or an error event in a stream.
  constructor(message, status = 0) {
    super(message);
    this.status = status;
  }
}

export const keyRequired = () => document.body.dataset.apiKey === "required";
export const savedKey = () => sessionStorage.getItem(KEY_ITEM);
export const saveKey = (key) => sessionStorage.setItem(KEY_ITEM, key);

function headers(extra = {}) {
  const key = savedKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    return new ApiError(`${response.status} ${response.statusText}`, response.status);
  }
  const error = body.error ?? {};
  return new ApiError(error.message ?? JSON.stringify(body), response.status);
}

async function send(path, init) {
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(`The server did not answer (${error.message}); is it running?`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJson(path, signal) {
  return (await send(path, { headers: headers(), signal })).json();
}

export async function postJson(path, body, signal) {
  const init = { method: "POST", body: JSON.stringify(body), headers: headers({ "Content-Type": "application/json" }), signal };
  return (await send(path, init)).json();
}

export async function deleteJson(path) {
  return (await send(path, { method: "DELETE", headers: headers() })).json();
}

export async function getBlob(path, signal) {
  return (await send(path, { headers: headers(), signal })).blob();
}

function* parseEvents(text) {
  // Complete SSE events in `text` as [event name, data]; comment lines (keep-alives) are skipped.
  for (const block of text.split("\n\n")) {
    let name = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (data.length) yield [name, JSON.parse(data.join("\n"))];
  }
}

// POST an image request with stream=true; calls onEvent(name, data) for each event until the
// stream ends. A refusal (4xx) or an `error` event throws ApiError; aborting `signal` cancels
// the request on the server too (it ends when its stream closes).
export async function streamImages(path, body, onEvent, signal) {
  const init = { method: "POST", signal };
  if (body instanceof FormData) {
    init.body = body;
    init.headers = headers();
  } else {
    init.body = JSON.stringify(body);
    init.headers = headers({ "Content-Type": "application/json" });
  }
  await readEvents(await send(path, init), onEvent);
}

// GET an event stream (a video's); calls onEvent(name, data) for each event until it ends.
export async function streamGet(path, onEvent, signal) {
  await readEvents(await send(path, { headers: headers(), signal }), onEvent);
}

async function readEvents(response, onEvent) {
  if (!response.headers.get("Content-Type")?.startsWith("text/event-stream")) {
    throw new ApiError(`Expected an event stream, got ${response.headers.get("Content-Type")}.`, response.status);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      pending = (pending + value).replaceAll("\r\n", "\n");
      const end = pending.lastIndexOf("\n\n");
      if (end < 0) continue;
      const complete = pending.slice(0, end);
      pending = pending.slice(end + 2);
      for (const [name, data] of parseEvents(complete)) {
        if (name === "error") {
          const error = data.error ?? {};
          throw new ApiError(error.message ?? "The request failed.");
        }
        onEvent(name, data);
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // whatever ended the loop, the stream is closed
  }
}
