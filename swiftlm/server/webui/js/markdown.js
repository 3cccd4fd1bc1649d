// Markdown -> sanitized HTML. Model output is untrusted: marked renders it, DOMPurify keeps only
// the tags and attributes below, links may only be http(s) or mailto and open in a new tab, and
// images become links (an <img> would make the browser fetch whatever host the model named).

import { Marked } from "../vendor/marked.esm.js";
import DOMPurify from "../vendor/purify.es.mjs";

const esc = (s) =>
  String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    image({ href, text }) {
      return `<a href="${esc(href || "")}">${esc(text || href || "image")}</a>`;
    },
    html({ text }) {
      return esc(text); // raw HTML in the answer is shown as text, not interpreted
    },
  },
});

const ALLOWED_TAGS = (
  "a b blockquote br code del em h1 h2 h3 h4 h5 h6 hr i li ol p pre s strong sub sup table tbody td th thead tr ul " +
  "input"
).split(" "); // input: the disabled checkbox of a task-list item
const ALLOWED_ATTR = ["href", "title", "class", "start", "align", "type", "checked", "disabled"];

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    const href = node.getAttribute("href") || "";
    if (!/^(https?:|mailto:)/i.test(href)) node.removeAttribute("href");
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
  if (node.tagName === "INPUT") {
    node.setAttribute("type", "checkbox"); // a task-list box, never a field to type into
    node.setAttribute("disabled", "");
  }
  if (node.hasAttribute("class") && !/^language-[\w+-]+$/.test(node.getAttribute("class"))) {
    node.removeAttribute("class"); // only the code fence's language survives
  }
});

export function renderMarkdown(text) {
  const html = marked.parse(text || "", { async: false });
  return DOMPurify.sanitize(html, {
    ALLOWED_TAGS,
    ALLOWED_ATTR: [...ALLOWED_ATTR, "target", "rel"],
    ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
  });
}
