// The page kit: what the InstantML pages share (functions/pages/kit.js). functions/api.page_html inlines
// this file where a page's script element says instantml:kit.js, so each page stays one self-contained document.
// It keeps the API token: given once on this origin (the token form, or a printed link's #token= fragment,
// taken out of the address bar at once) it is kept in this origin's local storage, so every page and link
// opened from it, in any tab, is signed in until the user signs out (the header's Sign out, which signs
// out every tab of the origin); it is never put in a URL. It sends the token with every request only as an
// Authorization header, turns a refused token (401, 403) into the token form with no data shown, polls
// every 5 s while the page wants it, the tab is visible and the user has not paused it (else, if the page
// asks, slowly, for what may appear), and keeps the live line, the pause box (in the fragment: #live=0) and
// #status.
// The page gives it its own parts once, with Kit.start. The kit's markup (kit.html) is the header (#title,
// #badge, #meta, the live line with a pause box and/or a Refresh button, and Sign out), #status, #token-form
// (which says where the token is kept) and #tip; the page's own markup has #content.
const Kit = (() => {
  'use strict';
  const TOKEN_KEY = 'instantml_token', POLL_MS = 5000;
  // Local storage is shared by every tab of this origin (scheme, host and port) and kept across restarts of
  // the browser: the sign-in carries to new tabs. A browser that refuses it (storage disabled) keeps the
  // token in this page's memory only: links then ask again, the token is never moved into them.
  const storage = (() => { try { return window.localStorage; } catch (e) { return null; } })();
  const $ = (id) => document.getElementById(id);
  // Every page is served under /v1/projects/{project}/.
  const parts = location.pathname.split('/');
  const project = decodeURIComponent(parts[parts.indexOf('projects') + 1] || '');
  let page = null; // Kit.start's options
  let token = null, needToken = false, failing = false;
  let timer = null, inflight = null, seq = 0, skew = 0;

  // ---------- formatting ----------
  const isNum = (v) => typeof v === 'number' && Number.isFinite(v);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined || v === '') return '–';
    if (typeof v !== 'number') return String(v);
    if (!Number.isFinite(v)) return Number.isNaN(v) ? 'NaN' : (v > 0 ? '∞' : '−∞');
    if (Number.isInteger(v) && Math.abs(v) < 1e9) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
    return String(+v.toPrecision(4));
  }
  // About `count` round axis ticks between lo and hi.
  function ticks(lo, hi, count) {
    const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  const now = () => Date.now() / 1000 + skew; // the server's clock, as far as its Date header tells
  // t (epoch seconds) as "12 s ago", "3 min ago", "2 h ago", "5 d ago".
  function ago(t) {
    if (!isNum(t)) return '—';
    const d = Math.max(0, now() - t);
    if (d < 60) return `${Math.round(d)} s ago`;
    if (d < 3600) return `${Math.floor(d / 60)} min ago`;
    if (d < 86400) return `${Math.floor(d / 3600)} h ago`;
    return `${Math.floor(d / 86400)} d ago`;
  }
  // One formatter for every cell: Date.prototype.toLocaleString builds one per call, 1,000 rows took ~0.3 s.
  // Built on first use: a page without dates (the Distributed tab) does not pay for it.
  let DATE = null;
  const dateTime = (t) => {
    if (!isNum(t)) return '';
    DATE = DATE || new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'medium' });
    return DATE.format(new Date(t * 1000));
  };
  // Trailing mean over `n` points (0: as logged); a point without a value stays without one. The run and
  // compare pages smooth run.log series with it (the tab smooths as TensorBoard does, its own way).
  function smoothed(values, n) {
    if (!n) return values;
    const out = new Array(values.length); let sum = 0, count = 0;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v !== null) { sum += v; count++; }
      const j = i - n;
      if (j >= 0 && values[j] !== null) { sum -= values[j]; count--; }
      out[i] = v === null ? null : sum / count;
    }
    return out;
  }

  function showTip(e, lines) {
    const tip = $('tip');
    tip.textContent = lines.join('\n');
    tip.hidden = false;
    const w = tip.offsetWidth, h = tip.offsetHeight;
    tip.style.left = (e.clientX + 14 + w > innerWidth ? e.clientX - w - 10 : e.clientX + 14) + 'px';
    tip.style.top = (e.clientY + 14 + h > innerHeight ? e.clientY - h - 10 : e.clientY + 14) + 'px';
  }
  const hideTip = () => { $('tip').hidden = true; };

  // ---------- token and URL fragment ----------
  function remember(t) {
    token = t;
    try { if (storage) storage.setItem(TOKEN_KEY, t); } catch (e) { /* in memory only */ }
  }
  function forget() {
    try { if (storage) storage.removeItem(TOKEN_KEY); } catch (e) { /* ignore */ }
    token = null;
  }
  function storedToken() {
    try {
      let t = storage && storage.getItem(TOKEN_KEY);
      // Pages before issue 24 kept it in the tab's session storage: carry it over once.
      const old = window.sessionStorage && sessionStorage.getItem(TOKEN_KEY);
      if (old) { sessionStorage.removeItem(TOKEN_KEY); if (!t) { t = old; remember(t); } }
      return t || null;
    } catch (e) { return null; }
  }
  // The fragment as it is but for the token, which is never written back; edit(params) sets the page's state.
  function writeHash(edit) {
    const p = new URLSearchParams(location.hash.slice(1)); // keeps unrelated fragment state
    p.delete('token');
    if (edit) edit(p);
    const s = p.toString().replace(/%2C/gi, ','); // lists (runs=a,b) stay readable: a comma is safe here
    history.replaceState(history.state, '', location.pathname + location.search + (s ? '#' + s : ''));
  }
  // Takes a token from the fragment (#token=...) into local storage and out of the URL; returns the
  // fragment's other parameters.
  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    const t = p.get('token');
    if (t) remember(t);
    p.delete('token');
    writeHash();
    return p;
  }
  // Links to other pages carry no token: the page they open finds it in local storage. (Kept for the pages
  // that still call it: the identity.)
  const withToken = (href) => href;
  function askToken(message, cls) {
    needToken = true;
    $('content').hidden = true;
    $('sign-out').hidden = true;
    if (page.signedOut) page.signedOut();
    setStatus(message || page.prompt, message ? (cls || 'error') : '');
    $('token-form').hidden = false;
    $('token-input').focus();
    schedule();
  }
  function signedIn(t) {
    token = t; needToken = false;
    $('token-input').value = ''; $('token-form').hidden = true; $('sign-out').hidden = false;
    setStatus('Loading…');
    (page.begin || page.load)();
  }
  function signOut() {
    forget();
    if (inflight) { inflight.abort(); inflight = null; seq++; }
    askToken('Signed out: the token is no longer kept in this browser. Enter it again to see the data.', 'warn');
  }

  // ---------- requests ----------
  function setStatus(text, cls) { const s = $('status'); s.textContent = text; s.className = cls || ''; }
  function errorText(body, res) {
    const err = body && body.error;
    if (!err) return `Request failed (HTTP ${res.status})`;
    const msg = err.message || `Request failed (HTTP ${res.status})`;
    const details = (err.details || []).filter((d) => d && d.message && !msg.includes(d.message))
      .map((d) => (d.field ? `${d.field}: ` : '') + d.message).join('; ');
    return msg + (details ? ` (${details})` : '');
  }
  // An answer that is not the data the page asked for: its error in #status; a server error (5xx) or a
  // rate limit (429) is retried in 5 s.
  function showError({ res, body }) {
    failing = res.status >= 500 || res.status === 429;
    setStatus(res.ok ? 'Unexpected response from server' : errorText(body, res), 'error');
  }
  // GET url with the token: { res, body } (body null when it is not JSON).
  async function fetchJson(url, signal) {
    const res = await fetch(url, { headers: { Authorization: 'Bearer ' + token, Accept: 'application/json' }, signal, cache: 'no-store' });
    let body = null;
    try { body = await res.json(); } catch (e) { body = null; }
    const date = Date.parse(res.headers.get('Date') || '');
    if (res.ok && Number.isFinite(date)) skew = (date - Date.now()) / 1000;
    return { res, body };
  }
  // One round of the page's requests, superseding the round in flight. send(signal) sends them with
  // fetchJson and resolves to one answer or a list of them. Without a token, or when one answer refuses it
  // (401, 403), the token form shows and no data; when the server is unreachable the round is retried in
  // 5 s; else handle(answers) shows them. settled(), if given, runs once the round is over and not
  // superseded; the next round is then scheduled.
  async function round(send, handle, settled) {
    clearTimeout(timer); timer = null;
    if (!token) { askToken(); return; }
    if (inflight) inflight.abort();
    const ctl = inflight = new AbortController(), my = ++seq;
    let answers;
    try {
      answers = await send(ctl.signal);
    } catch (e) {
      if (my !== seq) return;
      inflight = null; failing = true;
      if (settled) settled();
      setStatus('Server unreachable, retrying…', 'error');
      schedule();
      return;
    }
    if (my !== seq) return;
    inflight = null; failing = false;
    if (settled) settled();
    const denied = [].concat(answers).find((a) => a.res.status === 401 || a.res.status === 403);
    if (denied) {
      // A refused token (unknown, revoked) is forgotten on every tab; another project's token stays kept
      // for the pages of its own project, and this page asks for one of its own.
      if (denied.res.status === 401) forget(); else token = null;
      askToken(denied.res.status === 401 ? 'The API token was not accepted.'
        : `This API token does not grant access to project ${project}.`);
      return;
    }
    $('sign-out').hidden = false;
    handle(answers);
    schedule();
  }

  // ---------- polling and the live line ----------
  // Paused is part of the view: #live=0 in the fragment (a link, a reload, a new tab open paused too).
  const paused = () => $('pause').checked;
  function setPaused(on) {
    $('pause').checked = on;
    writeHash((p) => { if (on) p.set('live', '0'); else p.delete('live'); });
  }
  const wanted = () => !page.wanted || page.wanted();
  // page.slow (ms): how often to look again while the page does not want polling (a list that new runs
  // join, a run that may yet appear); without it, not at all.
  function schedule() {
    clearTimeout(timer); timer = null;
    const every = wanted() || failing ? POLL_MS : (typeof page.slow === 'function' ? page.slow() : page.slow) || 0;
    if (!needToken && !paused() && !document.hidden && every) timer = setTimeout(page.load, every);
    setLive();
  }
  function setLive() {
    const [cls, text] = needToken ? ['', 'waiting for token'] : paused() ? ['', 'paused']
      : document.hidden ? ['', 'paused (tab hidden)'] : failing ? ['err', 'retrying']
        : !wanted() ? ['', page.idle()] : ['on', 'live · every 5 s'];
    $('live').replaceChildren(el('span', '', 'dot ' + cls), document.createTextNode(text));
  }

  // The page's parts:
  //   prompt       what the token form asks, before any token was tried
  //   load()       a round (Kit.round) of the page's requests: polling, the pause box, a visible tab again
  //   begin()      the first round after a token was entered (default: load)
  //   hashchange(p) the fragment changed: p holds its parameters but the token; the page reloads
  //   wanted()     whether to keep polling (default: always); idle() then says why not, on the live line
  //   slow         ms (or a function giving them): while not wanted, look again this often (new runs,
  //                a run not there yet); 0 or absent: not at all
  //   signedOut()  the token was refused: forget the data shown
  //   pause        true: a pause box on the live line stops polling while ticked; the fragment says it
  //                (#live=0), so a link or a reload opens paused: one round to draw, then no request
  //   reload()     a Refresh button on the live line does this
  // Returns the fragment's parameters, for the page's own state.
  function start(options) {
    page = options;
    const p = readHash();
    if (!token) token = storedToken();
    $('sign-out').hidden = !token;
    $('sign-out').addEventListener('click', signOut);
    $('token-form').addEventListener('submit', (e) => {
      e.preventDefault();
      const t = $('token-input').value.trim();
      if (!t) return;
      remember(t);
      signedIn(t);
    });
    // Another tab of this origin signed in or out: follow it.
    window.addEventListener('storage', (e) => {
      if (e.key !== TOKEN_KEY && e.key !== null) return;
      const t = storedToken();
      if (t && t !== token && needToken) signedIn(t);
      else if (t && t !== token) { token = t; page.load(); }
      else if (!t && token) {
        token = null;
        if (inflight) { inflight.abort(); inflight = null; seq++; }
        askToken('Signed out in another tab. Enter the token again to see the data.', 'warn');
      }
    });
    if (page.pause) {
      $('pause-box').hidden = false;
      setPaused(p.get('live') === '0');
      $('pause').addEventListener('change', () => {
        setPaused(paused());
        if (paused()) schedule(); else page.load();
      });
    }
    if (page.reload) {
      $('reload').hidden = false;
      $('reload').addEventListener('click', page.reload);
    }
    document.addEventListener('visibilitychange', () => {
      if (document.hidden || needToken || paused() || !wanted()) schedule(); else page.load();
    });
    window.addEventListener('hashchange', () => {
      const q = readHash();
      if (needToken && token) { needToken = false; $('token-form').hidden = true; $('sign-out').hidden = false; }
      const was = paused(), now = !!page.pause && q.get('live') === '0';
      if (page.pause) $('pause').checked = now;
      page.hashchange(q);
      // Resumed by the link: ask now, unless the page's own answer to the change did.
      if (was && !now && !inflight && !needToken) page.load(); else if (now) schedule();
    });
    return p;
  }

  // The processes strip's states (contract 8), as the tab draws a rank and the runs page a run's processes
  // (the server's shared.processes.records.STRIP_STATES, in that order).
  const PROC_COLOURS = { running: '#2e9d57', silent: '#f0a202', stuck: '#d1495b', finished: '#98a2b3', failed: '#7a1f2b', signal: '#b07aa1', vanished: '#1d2939', none: '#eaecf0' };
  const PROC_WORDS = { running: 'running', silent: 'silent (alive, not logging)', stuck: 'stuck (named by the watch)', finished: 'ended: finished', failed: 'ended: failed', signal: 'ended by a signal', vanished: 'vanished', none: 'no record' };

  return {
    project, start, round, fetchJson, showError, setStatus, schedule, writeHash, withToken, paused,
    $, el, esc, isNum, fmt, ticks, ago, dateTime, showTip, hideTip, smoothed, PROC_COLOURS, PROC_WORDS,
  };
})();
