// The chat page of `mlxllama serve`. It talks only to this server's API, and puts every piece of
// model output and file metadata on the page as text (textContent), never as HTML.
"use strict";

const STORE = "mlxllama.conversations";
const KEY = "mlxllama.apiKey";
const $ = (id) => document.getElementById(id);

const state = { props: null, conversations: [], current: null, controller: null };

// ---- the API -------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

class ApiError extends Error {}

async function call(path, body) {
  let response;
  try {
    response = await fetch(path, body === undefined ? { headers: headers() }
      : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  } catch (e) {
    throw new ApiError(`cannot reach the server (${e.message})`);
  }
  if (!response.ok) throw await httpError(response);
  return response.json();
}

async function httpError(response) {
  let message = response.statusText;
  try { message = (await response.json()).error.message; } catch (e) { /* not our error body */ }
  if (response.status === 401) askForKey();
  return new ApiError(response.status === 401 ? `the server needs an API key (${message})`
    : `HTTP ${response.status}: ${message}`);
}

// Streams a completion, calling onText(piece) as text arrives; resolves to the last chunk's
// extras: {finish, prompt, usage}.
async function stream(path, body, signal, onText) {
  let response;
  try {
    response = await fetch(path, { method: "POST", headers: headers(), signal, body: JSON.stringify(body) });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(`cannot reach the server (${e.message})`);
  }
  if (!response.ok) throw await httpError(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const end = {};
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(`the reply's stream broke off (${e.message})`);
    }
    if (chunk.done) break;
    buffer += decoder.decode(chunk.value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const data = JSON.parse(line.slice(6));
        if (data.error) throw new ApiError(data.error.message);
        if (data.usage) end.usage = data.usage;
        if (data.prompt) end.prompt = data.prompt;
        const choice = (data.choices || [])[0];
        if (!choice) continue;
        const text = choice.delta ? choice.delta.content : choice.text;
        if (text) onText(text);
        if (choice.finish_reason) end.finish = choice.finish_reason;
      }
    }
  }
  if (!end.finish) throw new ApiError("the reply's stream ended before the reply did");
  return end;
}

// ---- conversations, kept in the browser's storage ------------------------------------------

function load() {
  try { state.conversations = JSON.parse(localStorage.getItem(STORE)) || []; } catch (e) { state.conversations = []; }
  state.current = state.conversations[0] || newConversation();
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations));
}

function newConversation() {
  const conversation = { id: `${Date.now()}-${Math.random().toString(16).slice(2)}`, title: "New conversation", turns: [] };
  state.conversations.unshift(conversation);
  save();
  return conversation;
}

// The messages of a conversation as OpenAI's API takes them: the system message, then each
// user message and its (templated) reply.
function messages(conversation, upTo) {
  const out = [];
  const system = settings().system;
  if (system) out.push({ role: "system", content: system });
  for (const turn of conversation.turns.slice(0, upTo)) {
    out.push({ role: "user", content: turn.user });
    if (turn.reply && turn.reply.content) out.push({ role: "assistant", content: turn.reply.content });
  }
  return out;
}

function exportConversation() {
  const transcript = { model: state.props ? state.props.path : null,
    template: templateChoice().label, messages: messages(state.current) };
  const blob = new Blob([JSON.stringify(transcript, null, 2) + "\n"], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `${state.current.title.slice(0, 40) || "conversation"}.json`;
  link.click();
  URL.revokeObjectURL(link.href);
}

// ---- settings ------------------------------------------------------------------------------

const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];

function settings() {
  const out = { system: $("system").value.trim() };
  for (const name of NUMBERS) if ($(name).value !== "") out[name] = Number($(name).value);
  const stop = $("stop").value.split("\n").filter((s) => s.length);
  if (stop.length) out.stop = stop;
  return out;
}

// The template a templated request uses: the model's own (no chat_template field), a built-in
// name, or "none" (the last message fed as raw text).
function templateChoice() {
  const value = $("template").value;
  if (value === "") return { field: undefined, label: state.props ? state.props.template.label : "the model's", source: state.props && state.props.template.source };
  if (value === "none") return { field: "none", label: "none", source: null };
  return { field: value, label: value, source: state.props.templates[value] };
}

function sampling() {
  const s = settings();
  const out = {};
  for (const name of [...NUMBERS, "stop"]) if (s[name] !== undefined) out[name] = s[name];
  return out;
}

// ---- sending -------------------------------------------------------------------------------

async function send(text) {
  const conversation = state.current;
  const compare = $("compare").checked;
  const turn = { user: text, reply: { content: "" }, raw: compare ? { content: "" } : undefined };
  conversation.turns.push(turn);
  if (conversation.title === "New conversation") conversation.title = text.slice(0, 60);
  save();
  render();
  await reply(conversation, conversation.turns.length - 1);
}

async function reply(conversation, index) {
  const turn = conversation.turns[index];
  const controller = new AbortController();
  state.controller = controller;
  for (const side of [turn.reply, turn.raw]) if (side) Object.assign(side, { content: "", info: undefined, error: undefined, stopped: false });
  setBusy(true);
  render();
  const choice = templateChoice();
  const jobs = [run(turn.reply, "/v1/chat/completions", {
    messages: messages(conversation, index).concat([{ role: "user", content: turn.user }]),
    chat_template: choice.field, ...common() }, controller.signal, choice)];
  if (turn.raw) jobs.push(run(turn.raw, "/v1/completions", { prompt: rawPrompt(conversation, index), ...common() },
    controller.signal, { label: "none", source: null }));
  await Promise.all(jobs);
  state.controller = null;
  setBusy(false);
  save();
  render();
}

function common() {
  return { ...sampling(), stream: true, stream_options: { include_usage: true }, return_prompt: true };
}

// The raw side of a compared conversation continues as plain text: its previous raw prompt and
// reply, then the new message.
function rawPrompt(conversation, index) {
  const before = conversation.turns.slice(0, index).reverse().find((t) => t.raw && t.raw.info && t.raw.info.prompt);
  return before ? `${before.raw.info.prompt.text}${before.raw.content}\n${conversation.turns[index].user}`
    : conversation.turns[index].user;
}

async function run(side, path, body, signal, template) {
  const started = performance.now();
  let first = null;
  try {
    const end = await stream(path, body, signal, (piece) => {
      if (first === null) first = performance.now();
      side.content += piece;
      renderLive(side);
    });
    const done = performance.now();
    const usage = end.usage || {};
    const generated = usage.completion_tokens || 0;
    side.info = {
      prompt: end.prompt, template: template.label, templateSource: template.source, finish: end.finish,
      promptTokens: usage.prompt_tokens, generated,
      cached: usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0,
      ttft: first === null ? null : (first - started) / 1000,
      tokensPerSecond: first !== null && generated > 1 ? (generated - 1) / ((done - first) / 1000) : null,
    };
    if (end.prompt) side.info.pieces = (await call("/detokenize", { tokens: end.prompt.token_ids, with_pieces: true })).pieces;
  } catch (e) {
    if (e.name === "AbortError") side.stopped = true;
    else side.error = e.message;
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").disabled = !busy;
}

function askForKey() {
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

// ---- rendering (text only) -----------------------------------------------------------------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}

// Reply text with its ``` code blocks kept as preformatted blocks.
function contentNode(text) {
  const box = el("div", "content");
  text.split(/```/).forEach((part, i) => {
    if (i % 2) {
      const code = el("code", null, part.replace(/^[^\n]*\n/, ""));
      const pre = el("pre");
      pre.append(code);
      box.append(pre);
    } else {
      box.append(document.createTextNode(part));
    }
  });
  return box;
}

const live = new Map(); // a reply being streamed -> its content node

function renderLive(side) {
  const node = live.get(side);
  if (!node) return;
  const fresh = contentNode(side.content);
  node.replaceWith(fresh);
  live.set(side, fresh);
}

function render() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((c) => {
    const item = el("li", c === state.current ? "active" : "", c.title);
    item.onclick = () => { if (!state.controller) { state.current = c; render(); } };
    return item;
  }));
  const box = $("messages");
  live.clear();
  box.replaceChildren(...state.current.turns.flatMap((turn, index) => [userNode(turn, index), replyNodes(turn, index)]));
  box.scrollTop = box.scrollHeight;
  const turns = state.current.turns;
  const compared = turns.some((t, i) => t.raw && turns.slice(0, i).some((u) => u.raw));
  $("notice").textContent = compared ? "The raw side is its own conversation, continued as plain text: its previous"
    + " raw prompt and reply, then the new message." : "";
}

function userNode(turn, index) {
  const node = el("div", "message user");
  const role = el("div", "role", "user");
  const edit = el("button", "edit", "Edit");
  edit.type = "button";
  edit.onclick = () => editMessage(node, index);
  role.append(edit);
  node.append(role, contentNode(turn.user));
  return node;
}

function replyNodes(turn, index) {
  const row = el("div", "turn");
  const last = index === state.current.turns.length - 1;
  row.append(replyNode(turn.reply, turn.raw ? "with template" : "assistant", last));
  if (turn.raw) row.append(replyNode(turn.raw, "without template (raw prompt)", false));
  return row;
}

function replyNode(side, label, last) {
  const node = el("div", side.error ? "message assistant error" : "message assistant");
  node.dataset.side = label.startsWith("without") ? "raw" : "templated";
  const role = el("div", "role", label);
  if (last && !state.controller) {
    const again = el("button", "regenerate", "Regenerate");
    again.type = "button";
    again.onclick = () => reply(state.current, state.current.turns.length - 1);
    role.append(again);
  }
  const content = contentNode(side.content);
  live.set(side, content);
  node.append(role, content);
  if (side.stopped) node.append(el("div", "finish", "[stopped]"));
  if (side.info && !side.content) node.append(el("div", "finish", side.info.finish === "stop"
    ? "[no text: its first token ended the reply]" : "[no text: no room to reply]"));
  if (side.error) node.append(el("div", "error-text", `Error: ${side.error}`));
  if (side.info) node.append(fedPanel(side.info));
  return node;
}

// What the model was fed: the rendered prompt with its special tokens marked, every token's piece
// and id (hover one for the other), the template's name and source, and the reply's figures.
function fedPanel(info) {
  const panel = el("details", "fed");
  panel.append(el("summary", null, "What the model was fed"));
  const f = (x, digits) => (x === null || x === undefined ? "-" : x.toFixed(digits));
  panel.append(el("div", "figures", `prompt tokens ${info.promptTokens ?? "-"} · cached ${info.cached ?? 0} · generated`
    + ` ${info.generated} · time to first token ${f(info.ttft, 3)} s · ${f(info.tokensPerSecond, 1)} tokens/s`
    + ` · finish: ${info.finish}`));
  panel.append(el("div", "template-name", `template: ${info.template}`));
  if (info.templateSource) {
    const source = el("details", "template-source");
    source.append(el("summary", null, "template source"), el("pre", null, info.templateSource));
    panel.append(source);
  }
  if (info.prompt && info.pieces) {
    const rendered = el("pre", "rendered");
    const specials = new Set(info.pieces.filter((p) => p.special).map((p) => p.piece));
    for (const part of splitSpecials(info.prompt.text, specials)) rendered.append(part.special ? el("mark", "special", part.text) : document.createTextNode(part.text));
    const pieces = el("div", "tokens pieces");
    const ids = el("div", "tokens ids");
    for (const p of info.pieces) {
      const piece = el("span", p.special ? "special" : "", p.piece);
      piece.title = `id ${p.id}`;
      const id = el("span", p.special ? "special" : "", String(p.id));
      id.title = p.piece;
      pieces.append(piece);
      ids.append(id);
    }
    panel.append(el("div", null, "rendered prompt:"), rendered, el("div", null, "pieces:"), pieces,
      el("div", null, `token ids (${info.pieces.length}):`), ids);
  }
  return panel;
}

function splitSpecials(text, specials) {
  if (!specials.size) return [{ text, special: false }];
  const escaped = [...specials].map((s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
  return text.split(new RegExp(`(${escaped.join("|")})`)).filter((t) => t).map((t) => ({ text: t, special: specials.has(t) }));
}

function editMessage(node, index) {
  if (state.controller) return;
  const box = el("textarea");
  box.value = state.current.turns[index].user;
  const resend = el("button", "resend", "Resend");
  resend.type = "button";
  resend.onclick = () => {
    const conversation = state.current;
    conversation.turns = conversation.turns.slice(0, index);
    save();
    send(box.value);
  };
  node.querySelector(".content").replaceWith(box, resend);
  box.focus();
}

// ---- start ---------------------------------------------------------------------------------

async function start() {
  load();
  render();
  $("composer").onsubmit = (e) => {
    e.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.controller) return;
    $("input").value = "";
    send(text);
  };
  $("input").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  };
  $("stop-button").onclick = () => state.controller && state.controller.abort();
  $("new-chat").onclick = () => { if (!state.controller) { state.current = newConversation(); render(); } };
  $("export").onclick = exportConversation;
  $("settings-toggle").onclick = () => {
    $("settings").hidden = !$("settings").hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!$("settings").hidden));
  };
  $("key-save").onclick = () => { sessionStorage.setItem(KEY, $("key-input").value); loadProps(); };
  await loadProps();
}

async function loadProps() {
  try {
    state.props = await call("/props");
  } catch (e) {
    $("notice").textContent = `Error: ${e.message}`;
    return;
  }
  $("notice").textContent = "";
  $("model-name").textContent = state.props.model;
  const select = $("template");
  const options = [["", `the model's (${state.props.template.label})`], ...Object.keys(state.props.templates).map((n) => [n, n]), ["none", "none (raw prompt)"]];
  select.replaceChildren(...options.map(([value, label]) => { const o = el("option", null, label); o.value = value; return o; }));
}

start();
