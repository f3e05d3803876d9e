// Markdown of model replies: marked parses, DOMPurify sanitises, highlight.js colours code.
// Raw HTML in a reply is shown as text (a model writing about <script> means the text), and
// DOMPurify removes what could still run (event attributes, javascript: links) from the rest.
// renderInto() patches only the top-level blocks that changed, so a streamed reply does not
// flicker: finished paragraphs and code blocks keep their DOM nodes (and any text selection).
import { Marked } from "marked";
import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/core";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import cpp from "highlight.js/lib/languages/cpp";
import css from "highlight.js/lib/languages/css";
import diff from "highlight.js/lib/languages/diff";
import go from "highlight.js/lib/languages/go";
import java from "highlight.js/lib/languages/java";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import markdown from "highlight.js/lib/languages/markdown";
import python from "highlight.js/lib/languages/python";
import rust from "highlight.js/lib/languages/rust";
import sql from "highlight.js/lib/languages/sql";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";

for (const [name, language] of Object.entries({ bash, c, cpp, css, diff, go, java, javascript, json, markdown,
  python, rust, sql, typescript, xml, yaml })) hljs.registerLanguage(name, language);

const escapeHtml = (text) => text.replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);

const marked = new Marked({ gfm: true, breaks: false });
marked.use({ renderer: { html: ({ text }) => escapeHtml(text) } });

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Sanitised HTML of `text` as a fragment of top-level nodes. */
function parse(text) {
  const template = document.createElement("template");
  template.innerHTML = DOMPurify.sanitize(marked.parse(text), { USE_PROFILES: { html: true } });
  return [...template.content.childNodes].filter((n) => n.nodeType === Node.ELEMENT_NODE || n.textContent.trim())
    .map((n) => {
      if (n.nodeType === Node.ELEMENT_NODE) return n;
      const p = document.createElement("p");
      p.append(n);
      return p;
    });
}

/** Highlighting, a language label and a copy button on code blocks; tables scroll on their own. */
function decorate(block) {
  if (block.tagName === "TABLE") {
    const wrap = document.createElement("div");
    wrap.className = "table-wrap";
    wrap.append(block);
    return wrap;
  }
  if (block.tagName !== "PRE" || !block.firstElementChild || block.firstElementChild.tagName !== "CODE") return block;
  const code = block.firstElementChild;
  const named = [...code.classList].find((c) => c.startsWith("language-"));
  let language = named ? named.slice(9) : "";
  if (language && hljs.getLanguage(language)) {
    code.innerHTML = hljs.highlight(code.textContent, { language, ignoreIllegals: true }).value;
  } else if (!language) {
    const guess = hljs.highlightAuto(code.textContent);
    if (guess.language && guess.relevance >= 5) code.innerHTML = guess.value;
  }
  code.classList.add("hljs");
  const figure = document.createElement("figure");
  figure.className = "code-block";
  const bar = document.createElement("figcaption");
  const label = document.createElement("span");
  label.className = "code-language";
  label.textContent = language || "text";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy-code";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${language || "text"} code`);
  copy.addEventListener("click", () => copyText(code.textContent, copy));
  bar.append(label, copy);
  figure.append(bar, block);
  return figure;
}

/** Copies `text` and says so on the button for a moment. */
export async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) {       // no clipboard API (an insecure origin): the old way
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const before = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = before; }, 1500);
}

/** Shows `text` as Markdown in `container`, replacing only the blocks that differ. */
export function renderInto(container, text) {
  const blocks = parse(text);
  const shown = [...container.children];
  blocks.forEach((block, i) => {
    const source = block.outerHTML;
    if (shown[i] && shown[i].markdownSource === source) return;
    const element = decorate(block);
    element.markdownSource = source;
    if (shown[i]) shown[i].replaceWith(element); else container.append(element);
  });
  for (const extra of shown.slice(blocks.length)) extra.remove();
}
