// The chat page: an API key (kept in localStorage), a model, the organization's conversations,
// and replies streamed token by token over fetch + SSE. Stop aborts the fetch, which cancels the
// generation upstream; the gateway keeps the partial reply, so a reload shows it.
"use strict";

// A reply is capped so a small model cannot ramble to the end of its context.
const MAX_REPLY_TOKENS = 512;

const $ = (id) => document.getElementById(id);
const state = { key: localStorage.getItem("llmserve.apiKey") || "", conversation: localStorage.getItem("llmserve.conversation") || "", abort: null };

function status(text) { $("status").textContent = text || ""; }

async function api(path, options = {}) {
  const reply = await fetch(path, { ...options, headers: { "Authorization": `Bearer ${state.key}`, "Content-Type": "application/json", ...(options.headers || {}) } });
  if (!reply.ok) {
    let message = reply.statusText;
    try { message = (await reply.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(`${reply.status}: ${message}`);
  }
  return reply;
}

function addMessage(role, content, partial) {
  const div = document.createElement("div");
  div.className = `message ${role}` + (partial ? " partial" : "");
  div.textContent = content;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function loadModels() {
  const models = (await (await api("/v1/models")).json()).data;
  $("model").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
}

async function loadConversations() {
  const list = (await (await api("/v1/conversations?limit=50")).json()).data;
  $("conversations").replaceChildren(...list.map((c) => {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    li.textContent = c.title || c.id;
    li.className = c.id === state.conversation ? "current" : "";
    li.onclick = () => openConversation(c.id);
    return li;
  }));
}

async function openConversation(id) {
  state.conversation = id;
  localStorage.setItem("llmserve.conversation", id);
  $("messages").replaceChildren();
  if (!id) return;
  try {
    const conversation = await (await api(`/v1/conversations/${encodeURIComponent(id)}`)).json();
    if (conversation.model) $("model").value = conversation.model;
    for (const m of conversation.messages) if (m.role !== "system") addMessage(m.role, m.content, m.partial);
  } catch (e) {
    state.conversation = "";
    localStorage.removeItem("llmserve.conversation");
    status(e.message);
  }
  await loadConversations();
}

// Yields the JSON of each `data:` event of an SSE body; comments (keep-alives) are skipped.
async function* sseEvents(body) {
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

async function send(text) {
  if (!state.conversation) {
    const created = await (await api("/v1/conversations", { method: "POST", body: JSON.stringify({ model: $("model").value, title: text.slice(0, 60) }) })).json();
    state.conversation = created.id;
    localStorage.setItem("llmserve.conversation", created.id);
    await loadConversations();
  }
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  state.abort = new AbortController();
  $("stop").disabled = false;
  $("send").disabled = true;
  try {
    const reply = await api("/v1/chat/completions", {
      method: "POST", signal: state.abort.signal,
      body: JSON.stringify({ model: $("model").value, stream: true, max_completion_tokens: MAX_REPLY_TOKENS, conversation_id: state.conversation, messages: [{ role: "user", content: text }] }),
    });
    for await (const chunk of sseEvents(reply.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices) if (choice.delta && choice.delta.content) bubble.textContent += choice.delta.content;
      bubble.scrollIntoView({ block: "end" });
    }
  } catch (e) {
    if (e.name === "AbortError") bubble.classList.add("partial"); else status(e.message);
  } finally {
    state.abort = null;
    $("stop").disabled = true;
    $("send").disabled = false;
  }
}

async function start() {
  $("api-key").value = state.key;
  if (!state.key) { status("Enter an API key."); return; }
  try {
    await loadModels();
    await loadConversations();
    await openConversation(state.conversation);
    status("");
  } catch (e) { status(e.message); }
}

$("save-key").onclick = () => { state.key = $("api-key").value.trim(); localStorage.setItem("llmserve.apiKey", state.key); start(); };
$("new-conversation").onclick = () => openConversation("");
$("stop").onclick = () => state.abort && state.abort.abort();
$("composer").onsubmit = (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.abort) return;
  $("prompt").value = "";
  send(text);
};
start();
