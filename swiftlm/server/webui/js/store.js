// Conversations and settings kept in this browser's localStorage (nothing is stored on the
// server). The API key stays in sessionStorage unless the user asks to remember it.

const CHATS = "swiftlm.chats.v1";
const SETTINGS = "swiftlm.settings.v1";
const KEY = "swiftlm.apikey";

function read(storage, name, fallback) {
  try {
    const v = storage.getItem(name);
    return v === null ? fallback : JSON.parse(v);
  } catch {
    return fallback;
  }
}

export function loadChats() {
  const data = read(localStorage, CHATS, null);
  return data && Array.isArray(data.chats) ? data : { chats: [], current: null };
}

// Save; when the browser's quota is full, drop the attachments' data (oldest chats first) and
// keep their names, so the text of every conversation survives. Returns false if that was needed.
export function saveChats(data) {
  try {
    localStorage.setItem(CHATS, JSON.stringify(data));
    return true;
  } catch {
    for (const chat of [...data.chats].sort((a, b) => a.updated - b.updated)) {
      for (const m of chat.messages) for (const a of m.attachments || []) a.url = null;
      try {
        localStorage.setItem(CHATS, JSON.stringify(data));
        return false;
      } catch {
        // still too large: go on with the next chat
      }
    }
    return false;
  }
}

export const loadSettings = () => read(localStorage, SETTINGS, {});

export function saveSettings(s) {
  try {
    localStorage.setItem(SETTINGS, JSON.stringify(s));
  } catch {
    // quota full: settings stay for this page only
  }
}

export function loadKey() {
  return sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "";
}

export function saveKey(key, remember) {
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
  if (key) (remember ? localStorage : sessionStorage).setItem(KEY, key);
}

export const keyRemembered = () => localStorage.getItem(KEY) !== null;

export function newId() {
  const a = new Uint8Array(8);
  crypto.getRandomValues(a);
  return Array.from(a, (b) => b.toString(16).padStart(2, "0")).join("");
}
