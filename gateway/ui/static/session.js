// One session: its JSON view (GET /v1/sessions/{id}: counts, branches, chat record; no arrays) and one trajectory's
// compact data (GET /ui/api/sessions/{id}/data?branch=N: the sample's arrays as safetensors, the turn log and token
// texts in its metadata). Everything per token is drawn on canvases, only the visible columns (a 32k-token,
// 48-layer top-8 session is 12.6M routing cells: never one DOM node per cell). Text from the session (token pieces,
// the chat record, metadata, errors) is only ever written with textContent or onto a canvas.
"use strict";

(() => {
  const { api, el, setText, number, withLogin } = Inspector;
  const timings = { frames: [] };
  window.inspectorTimings = timings; // read by the tests and the bench (row: inspector render)

  const ROLE_NAMES = ["prompt", "model (trainable)", "tool / appended (not trainable)"];
  const ROLE_COLOURS = ["#8aa4c8", "#3fa36b", "#e8a33d"];
  const VERSION_COLOURS = ["#6c5ce7", "#00a0a0", "#d35400", "#2e86de", "#c2185b", "#7cb342", "#8d6e63", "#546e7a"];
  const GUTTER = 70; // the row labels, left of the tracks
  const TICK_H = 14, TURN_H = 16, TOK_H = 24, VER_H = 14, LP_H = 64, GAP = 4;
  const MAX_SPACER_PX = 15e6; // below every browser's largest element width
  const TEXT_WINDOW = 1500; // tokens of the text panel around the token shown
  const TOP_P_SHOWN = 32;

  const sessionId = decodeURIComponent(window.location.pathname.replace(/^\/ui\/sessions\//, ""));
  const S = {
    view: null, d: null, branch: null, cw: 32, zoom: "32", scroll: 0, hover: -1, hoverRow: -1, pinned: -1,
    layout: null, drawQueued: false, textKey: null,
  };

  // ---- data ----------------------------------------------------------------------------------------------------
  const DTYPES = {
    F32: Float32Array, F64: Float64Array, I8: Int8Array, I16: Int16Array, I32: Int32Array,
    U8: Uint8Array, U16: Uint16Array, U32: Uint32Array, I64: BigInt64Array,
  };

  // safetensors: an 8-byte little-endian header length, the JSON header, the tensors' bytes (views where aligned).
  function parseSafetensors(buffer) {
    const headerLength = Number(new DataView(buffer).getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 8, headerLength)));
    const base = 8 + headerLength;
    const tensors = {};
    for (const [name, spec] of Object.entries(header)) {
      if (name === "__metadata__") continue;
      const Type = DTYPES[spec.dtype];
      if (!Type) throw new Error(`tensor ${name}: dtype ${spec.dtype} is not supported`);
      const [start, end] = spec.data_offsets;
      const offset = base + start;
      const length = (end - start) / Type.BYTES_PER_ELEMENT;
      const data = offset % Type.BYTES_PER_ELEMENT === 0
        ? new Type(buffer, offset, length) : new Type(buffer.slice(offset, base + end));
      tensors[name] = { shape: spec.shape, data };
    }
    return { tensors, meta: header.__metadata__ || {} };
  }

  function derive(parsed) {
    const { tensors: t, meta } = parsed;
    const tokens = t.tokens.data;
    const N = tokens.length;
    const P = parseInt(meta.prompt_length, 10) || 0;
    const lossMask = t.loss_mask.data;
    const logProbs = t.rollout_log_probs.data;
    const role = new Uint8Array(N);
    let trainable = 0;
    for (let i = P; i < N; i++) {
      const m = lossMask[i - P];
      role[i] = m ? 1 : 2;
      trainable += m ? 1 : 0;
    }
    let minLp = 0, minPos = -1;
    for (let i = P; i < N; i++) {
      if (role[i] === 1 && logProbs[i - P] < minLp) { minLp = logProbs[i - P]; minPos = i; }
    }
    const turnLog = JSON.parse(meta.turn_log || "[]");
    const turns = [];
    const turnOf = new Int32Array(N).fill(-1);
    let at = P;
    turnLog.forEach((turn, index) => {
      const start = at, end = Math.min(N, at + turn.num_tokens);
      turns.push({ index, kind: turn.kind, start, end, finish: turn.finish_reason, version: turn.weight_version });
      turnOf.fill(index, start, end);
      at = end;
    });
    const routing = t.rollout_routed_experts;
    const d = {
      meta, tokens, N, P, lossMask, logProbs, role, trainable, minLp, minPos, turns, turnOf,
      topIds: t.rollout_top_p_token_ids ? t.rollout_top_p_token_ids.data : null,
      topOffsets: t.rollout_top_p_token_offsets ? t.rollout_top_p_token_offsets.data : null,
      versionIds: t.rollout_weight_version_ids ? t.rollout_weight_version_ids.data : null,
      versionTable: JSON.parse(meta.weight_version_table || "[]"),
      pieces: meta.pieces ? JSON.parse(meta.pieces) : null,
      versionSpans: [],
      routed: null, R: 0, L: parseInt(meta.num_layers || "0", 10), K: parseInt(meta.moe_router_topk || "0", 10), E: 0,
    };
    d.versionSpans = versionSpans(d);
    if (routing && routing.shape.length === 3) {
      [d.R, d.L, d.K] = routing.shape;
      d.routed = routing.data;
      let max = -1;
      for (let i = 0; i < d.routed.length; i++) if (d.routed[i] > max) max = d.routed[i];
      d.E = max + 1;
      d.load = expertLoad(d);
      d.palette = expertPalette(d.E);
    }
    return d;
  }

  // Runs of the model tokens' weight versions, as absolute positions [start, end): where the weights changed under
  // the trajectory (a weight update mid-answer, a resumed turn, an update between turns). Tool tokens and tokens of
  // no known version do not break a run.
  function versionSpans(d) {
    const spans = [];
    if (!d.versionIds) return spans;
    for (let i = d.P; i < d.N; i++) {
      const v = d.versionIds[i - d.P];
      if (d.role[i] !== 1 || v < 0) continue;
      const last = spans[spans.length - 1];
      if (last && last.version === v) { last.end = i + 1; last.tokens++; continue; }
      spans.push({ version: v, name: d.versionTable[v], start: i, end: i + 1, tokens: 1 });
    }
    return spans;
  }

  function expertLoad(d) {
    const { routed, R, L, K, E } = d;
    const counts = new Uint32Array(L * E);
    for (let r = 0; r < R; r++) {
      const row = r * L * K;
      for (let l = 0; l < L; l++) {
        const base = row + l * K, out = l * E;
        for (let k = 0; k < K; k++) counts[out + routed[base + k]]++;
      }
    }
    return counts;
  }

  // Expert id -> colour: the hue walks the ids (neighbours stay apart by alternating the lightness).
  function expertPalette(E) {
    const css = [], packed = new Uint32Array(Math.max(1, E));
    for (let e = 0; e < E; e++) {
      const [r, g, b] = hslToRgb((e / Math.max(1, E)) * 330, 0.72, e % 2 ? 0.62 : 0.42);
      css.push(`rgb(${r},${g},${b})`);
      packed[e] = (255 << 24) | (b << 16) | (g << 8) | r; // ImageData is RGBA in memory: little-endian ABGR
    }
    return { css, packed };
  }

  function hslToRgb(h, s, l) {
    const c = (1 - Math.abs(2 * l - 1)) * s, x = c * (1 - Math.abs(((h / 60) % 2) - 1)), m = l - c / 2;
    const [r, g, b] = h < 60 ? [c, x, 0] : h < 120 ? [x, c, 0] : h < 180 ? [0, c, x] : h < 240 ? [0, x, c]
      : h < 300 ? [x, 0, c] : [c, 0, x];
    return [Math.round((r + m) * 255), Math.round((g + m) * 255), Math.round((b + m) * 255)];
  }

  // ---- what a token is -----------------------------------------------------------------------------------------
  function piece(d, i) {
    return d.pieces ? d.pieces[d.tokens[i]] : undefined;
  }

  function shortLabel(d, i) {
    const p = piece(d, i);
    if (p === undefined) return String(d.tokens[i]);
    return p.replace(/\n/g, "↵").replace(/\t/g, "⇥");
  }

  function finishText(finish) {
    if (!finish) return "";
    return finish.type + (finish.message ? `: ${finish.message}` : "");
  }

  function turnText(d, i) {
    const index = d.turnOf[i];
    if (index < 0) return "prompt";
    const turn = d.turns[index];
    const finish = turn.kind === "model" ? ` · finish ${finishText(turn.finish) || "none"}` : "";
    return `T${index + 1} (${turn.kind}, tokens ${turn.start}–${turn.end - 1})${finish}`;
  }

  function versionOf(d, i) {
    if (i < d.P || !d.versionIds) return null;
    const id = d.versionIds[i - d.P];
    return id >= 0 ? id : null;
  }

  // ---- the tracks canvas ---------------------------------------------------------------------------------------
  function layout(d) {
    const rows = d.routed ? d.L * d.K : 0;
    const rowH = rows ? Math.max(1, Math.min(10, Math.floor(384 / rows))) : 0;
    const tickY = 0, turnY = TICK_H, tokY = turnY + TURN_H, verY = tokY + TOK_H + GAP, lpY = verY + VER_H + GAP;
    const heatY = lpY + LP_H + GAP;
    const height = heatY + rows * rowH + (rows ? GAP : 0);
    return { rows, rowH, tickY, turnY, tokY, verY, lpY, heatY, heatH: rows * rowH, height };
  }

  // The canvas at this CSS size, cleared. Its backing store is reallocated only when the size changes: a redraw
  // while scrolling must not pay for a new one.
  function canvasSize(canvas, width, height) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.round(width * dpr), h = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    if (canvas.width !== w || canvas.height !== h) {
      canvas.width = w;
      canvas.height = h;
      canvas.style.width = `${width}px`;
      canvas.style.height = `${height}px`;
    }
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }

  function plotWidth() {
    return Math.max(1, document.getElementById("tracks").clientWidth - GUTTER);
  }

  function setZoom(zoom, keepToken) {
    const d = S.d;
    const plotW = plotWidth();
    const centre = keepToken !== undefined ? keepToken : (S.scroll + plotW / 2) / S.cw;
    S.zoom = zoom;
    let cw = zoom === "fit" ? plotW / Math.max(1, d.N) : parseFloat(zoom);
    cw = Math.min(cw, MAX_SPACER_PX / Math.max(1, d.N));
    S.cw = cw;
    document.getElementById("hspacer").style.width = `${GUTTER + d.N * cw}px`;
    scrollTo(centre * cw - plotW / 2);
    document.getElementById("zoom").value = zoom;
  }

  function scrollTo(px) {
    const max = Math.max(0, S.d.N * S.cw - plotWidth());
    S.scroll = Math.max(0, Math.min(max, px));
    const bar = document.getElementById("hscroll");
    if (Math.abs(bar.scrollLeft - S.scroll) > 1) bar.scrollLeft = S.scroll;
    queueDraw();
  }

  function queueDraw() {
    if (S.drawQueued) return;
    S.drawQueued = true;
    requestAnimationFrame(() => {
      S.drawQueued = false;
      const start = performance.now();
      drawTracks();
      drawOverlay();
      timings.frames.push(performance.now() - start);
      if (timings.frames.length > 500) timings.frames.shift();
    });
  }

  // Runs of equal colour over the visible columns: one fillRect per run. A column is a token when a token is at
  // least a pixel wide, else a pixel (which shows the token under its left edge).
  function fillRuns(ctx, y, h, colourAt) {
    const d = S.d, cw = S.cw, plotW = plotWidth();
    let runColour = null, runX = 0;
    const flush = (xEnd) => {
      if (runColour) { ctx.fillStyle = runColour; ctx.fillRect(runX, y, xEnd - runX, h); }
    };
    if (cw >= 1) {
      const first = Math.floor(S.scroll / cw), last = Math.min(d.N, Math.ceil((S.scroll + plotW) / cw));
      const gap = cw >= 6 ? 1 : 0;
      for (let i = first; i < last; i++) {
        const x = GUTTER + i * cw - S.scroll;
        const colour = colourAt(i);
        if (gap) {
          if (colour) { ctx.fillStyle = colour; ctx.fillRect(x, y, cw - gap, h); }
          continue;
        }
        if (colour !== runColour) { flush(x); runColour = colour; runX = x; }
      }
      if (!gap) flush(GUTTER + last * cw - S.scroll);
      return;
    }
    for (let px = 0; px < plotW; px++) {
      const i = Math.floor((S.scroll + px) / cw);
      const colour = i < d.N ? colourAt(i) : null;
      if (colour !== runColour) { flush(GUTTER + px); runColour = colour; runX = GUTTER + px; }
    }
    flush(GUTTER + plotW);
  }

  function drawTracks() {
    const d = S.d, lay = S.layout, cw = S.cw;
    const canvas = document.getElementById("tracks-canvas");
    const width = document.getElementById("tracks").clientWidth;
    const ctx = canvasSize(canvas, width, lay.height);
    const plotW = width - GUTTER;
    const x = (i) => GUTTER + i * cw - S.scroll;
    const first = Math.max(0, Math.floor(S.scroll / cw));
    const last = Math.min(d.N, Math.ceil((S.scroll + plotW) / cw));
    canvas.dataset.cellWidth = String(cw);
    canvas.dataset.scroll = String(S.scroll);
    canvas.dataset.gutter = String(GUTTER);
    canvas.dataset.tokenY = String(lay.tokY + TOK_H / 2);
    canvas.dataset.heatY = String(lay.heatY);
    canvas.dataset.rowHeight = String(lay.rowH);

    ctx.save();
    ctx.beginPath();
    ctx.rect(GUTTER, 0, plotW, lay.height);
    ctx.clip();
    // tokens by role, their text when there is room
    fillRuns(ctx, lay.tokY, TOK_H, (i) => ROLE_COLOURS[d.role[i]]);
    if (cw >= 14) {
      ctx.font = "11px ui-monospace, 'DejaVu Sans Mono', monospace";
      ctx.fillStyle = "#10151f";
      ctx.textBaseline = "middle";
      const chars = Math.max(1, Math.floor((cw - 3) / 6.7));
      for (let i = first; i < last; i++) {
        let label = shortLabel(d, i);
        if (label.length > chars) label = `${label.slice(0, Math.max(1, chars - 1))}…`;
        ctx.fillText(label, x(i) + 2, lay.tokY + TOK_H / 2);
      }
    }
    // weight versions: a band under the model tokens, each span named, a line where the weights changed
    fillRuns(ctx, lay.verY, VER_H, (i) => {
      const v = versionOf(d, i);
      return v === null ? (d.role[i] === 2 ? "#eceff3" : null) : VERSION_COLOURS[v % VERSION_COLOURS.length];
    });
    drawVersionSpans(ctx, d, lay, first, last, x);
    drawLogProbs(ctx, d, lay, first, last, x);
    if (d.routed) drawHeat(ctx, d, lay, plotW);
    drawTurns(ctx, d, lay, first, last, x);
    drawTicks(ctx, d, lay, plotW);
    ctx.restore();
    drawGutter(ctx, d, lay);
  }

  function drawVersionSpans(ctx, d, lay, first, last, x) {
    const canvas = document.getElementById("tracks-canvas");
    canvas.dataset.versionSwitches = d.versionSpans.slice(1).map((span) => span.start).join(",");
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    d.versionSpans.forEach((span, index) => {
      if (span.end < first || span.start > last) return;
      const px = Math.round(x(span.start)) + 0.5;
      if (index > 0) {
        ctx.strokeStyle = "#10151f";
        ctx.lineWidth = 2;
        ctx.beginPath();
        ctx.moveTo(px, lay.tokY);
        ctx.lineTo(px, lay.verY + VER_H);
        ctx.stroke();
        ctx.lineWidth = 1;
      }
      const room = (span.end - span.start) * S.cw - 6;
      if (ctx.measureText(span.name).width <= room) {
        ctx.fillStyle = "#ffffff";
        ctx.fillText(span.name, Math.max(px, GUTTER) + 3, lay.verY + VER_H / 2 + 0.5);
      }
    });
  }

  function drawLogProbs(ctx, d, lay, first, last, x) {
    const floor = d.minLp < 0 ? d.minLp : -1;
    const y = (lp) => lay.lpY + 3 + (lp / floor) * (LP_H - 6);
    ctx.strokeStyle = "#d9dee7";
    ctx.beginPath();
    ctx.moveTo(GUTTER, y(0) + 0.5);
    ctx.lineTo(GUTTER + plotWidth(), y(0) + 0.5);
    ctx.stroke();
    ctx.strokeStyle = "#2f6fdb";
    ctx.lineWidth = 1.2;
    ctx.beginPath();
    let drawing = false;
    if (S.cw >= 1) {
      for (let i = first; i < last; i++) {
        if (d.role[i] !== 1) { drawing = false; continue; }
        const px = x(i) + S.cw / 2, py = y(d.logProbs[i - d.P]);
        if (drawing) ctx.lineTo(px, py); else ctx.moveTo(px, py);
        drawing = true;
      }
    } else {
      // a pixel holds several tokens: its lowest model log-prob
      const plotW = plotWidth();
      for (let px = 0; px < plotW; px++) {
        const a = Math.floor((S.scroll + px) / S.cw), b = Math.min(d.N, Math.floor((S.scroll + px + 1) / S.cw));
        let low = 1;
        for (let i = a; i < Math.max(b, a + 1) && i < d.N; i++) {
          if (d.role[i] === 1 && d.logProbs[i - d.P] < low) low = d.logProbs[i - d.P];
        }
        if (low > 0) { drawing = false; continue; }
        if (drawing) ctx.lineTo(GUTTER + px, y(low)); else ctx.moveTo(GUTTER + px, y(low));
        drawing = true;
      }
    }
    ctx.stroke();
    ctx.lineWidth = 1;
    if (d.minPos >= 0 && d.minPos >= first && d.minPos < Math.max(last, first + 1)) {
      const px = x(d.minPos) + Math.max(S.cw, 1) / 2, py = y(d.minLp);
      ctx.fillStyle = "#c0392b";
      ctx.beginPath();
      ctx.arc(px, py, 4, 0, 2 * Math.PI);
      ctx.fill();
      ctx.font = "11px system-ui, sans-serif";
      ctx.textBaseline = "bottom";
      ctx.fillText(`lowest ${d.minLp.toFixed(3)}`, px + 6, Math.max(lay.lpY + 12, py - 2));
    }
  }

  // The heatmap at one pixel per column and per (layer, slot) row, written into a reused ImageData row by row (runs
  // of columns that show the same token are one fill), then scaled onto the tracks.
  function drawHeat(ctx, d, lay, plotW) {
    const width = Math.max(1, Math.floor(plotW)), rows = lay.rows;
    const scratch = S.heatCanvas || (S.heatCanvas = document.createElement("canvas"));
    if (scratch.width !== width || scratch.height !== rows || !S.heatImage) {
      scratch.width = width;
      scratch.height = rows;
      S.heatImage = scratch.getContext("2d").createImageData(width, rows);
      S.heatPixels = new Uint32Array(S.heatImage.data.buffer);
    }
    const out = S.heatPixels;
    const { routed, R } = d, packed = d.palette.packed;
    const starts = [], tokens = [];
    for (let px = 0; px < width;) {
      const i = Math.floor((S.scroll + px) / S.cw);
      let end = Math.min(width, Math.ceil((i + 1) * S.cw - S.scroll));
      if (end <= px) end = px + 1;
      starts.push(px);
      tokens.push(i < R ? i * rows : -1);
      px = end;
    }
    starts.push(width);
    for (let j = 0; j < rows; j++) {
      const row = j * width;
      for (let s = 0; s < tokens.length; s++) {
        const base = tokens[s];
        out.fill(base < 0 ? 0 : packed[routed[base + j]], row + starts[s], row + starts[s + 1]);
      }
    }
    scratch.getContext("2d").putImageData(S.heatImage, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(scratch, 0, 0, width, rows, GUTTER, lay.heatY, width, lay.heatH);
    if (lay.rowH * d.K >= 6) { // layer separators where they can be seen
      ctx.strokeStyle = "rgba(255,255,255,0.8)";
      ctx.beginPath();
      for (let l = 1; l < d.L; l++) {
        const yy = lay.heatY + l * d.K * lay.rowH + 0.5;
        ctx.moveTo(GUTTER, yy);
        ctx.lineTo(GUTTER + width, yy);
      }
      ctx.stroke();
    }
  }

  function drawTurns(ctx, d, lay, first, last, x) {
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    const marks = [{ at: 0, label: "prompt", colour: "#3b4456" }];
    for (const turn of d.turns) {
      const finish = turn.kind === "model" && turn.finish ? ` · ${turn.finish.type}` : "";
      marks.push({ at: turn.start, end: turn.end, label: `T${turn.index + 1} ${turn.kind}${finish}`, colour: "#3b4456" });
    }
    for (const fork of forkMarks(d)) marks.push(fork);
    for (const mark of marks) {
      if (mark.at < first - 1 || mark.at > last) continue;
      const px = Math.round(x(mark.at)) + 0.5;
      ctx.strokeStyle = mark.colour;
      ctx.setLineDash(mark.dash ? [4, 3] : []);
      ctx.beginPath();
      ctx.moveTo(px, lay.turnY);
      ctx.lineTo(px, lay.height);
      ctx.stroke();
      ctx.fillStyle = mark.colour;
      if (mark.dash) { // forks: labelled inside the log-prob track, clear of the turn labels
        ctx.fillText(mark.label, px + 3, lay.lpY + 8);
        continue;
      }
      const room = mark.end !== undefined ? (mark.end - mark.at) * S.cw - 6 : 200;
      const label = ctx.measureText(mark.label).width <= room ? mark.label : mark.label.split(" ")[0];
      if (ctx.measureText(label).width <= room) ctx.fillText(label, px + 3, lay.turnY + TURN_H / 2);
    }
    ctx.setLineDash([]);
  }

  // Where this trajectory starts from its parent, and where other branches leave it (when the view says).
  function forkMarks(d) {
    const marks = [];
    const info = branchInfo().find((b) => b.branch === S.branch);
    if (info) {
      // A branch continues from a prefix of its parent, which is its prompt (the view names the point when it can).
      const fork = info.fork_token ?? (S.branch > 0 ? d.P : undefined);
      if (fork !== undefined && fork !== null) {
        const from = info.parent !== undefined && info.parent !== null ? ` from b${info.parent}` : "";
        marks.push({ at: fork, label: `fork${from}`, colour: "#b02fb0", dash: true });
      }
    }
    for (const other of branchInfo()) {
      if (other.parent === S.branch && other.fork_token !== undefined && other.fork_token !== null) {
        marks.push({ at: other.fork_token, label: `→ b${other.branch}`, colour: "#b02fb0", dash: true });
      }
    }
    return marks;
  }

  function drawTicks(ctx, d, lay, plotW) {
    const minPx = 90;
    let step = 1;
    while (step * S.cw < minPx) step *= step.toString()[0] === "2" ? 2.5 : 2;
    step = Math.round(step);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#667085";
    ctx.textBaseline = "middle";
    ctx.strokeStyle = "#c5ccd8";
    const start = Math.floor(S.scroll / S.cw / step) * step;
    for (let i = start; i <= d.N; i += step) {
      const px = GUTTER + i * S.cw - S.scroll;
      if (px > GUTTER + plotW) break;
      if (px < GUTTER) continue;
      ctx.beginPath();
      ctx.moveTo(px + 0.5, lay.tickY + TICK_H - 4);
      ctx.lineTo(px + 0.5, lay.tickY + TICK_H);
      ctx.stroke();
      ctx.fillText(number(i), px + 3, lay.tickY + TICK_H / 2);
    }
  }

  function drawGutter(ctx, d, lay) {
    ctx.fillStyle = "#f3f5f8";
    ctx.fillRect(0, 0, GUTTER, lay.height);
    ctx.strokeStyle = "#d9dee7";
    ctx.beginPath();
    ctx.moveTo(GUTTER - 0.5, 0);
    ctx.lineTo(GUTTER - 0.5, lay.height);
    ctx.stroke();
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#3b4456";
    ctx.textBaseline = "middle";
    const label = (text, y) => ctx.fillText(text, 6, y);
    label("position", lay.tickY + TICK_H / 2);
    label("turns", lay.turnY + TURN_H / 2);
    label("tokens", lay.tokY + TOK_H / 2);
    label("version", lay.verY + VER_H / 2);
    label("log-prob", lay.lpY + 10);
    ctx.fillStyle = "#667085";
    ctx.font = "10px system-ui, sans-serif";
    label("0", lay.lpY + 24);
    label((d.minLp < 0 ? d.minLp : -1).toFixed(2), lay.lpY + LP_H - 6);
    if (d.routed) {
      ctx.fillStyle = "#3b4456";
      ctx.font = "11px system-ui, sans-serif";
      label("routing", lay.heatY + 8);
      ctx.fillStyle = "#667085";
      ctx.font = "10px system-ui, sans-serif";
      label(`L0 … L${d.L - 1}`, lay.heatY + 22);
      label(`× top-${d.K}`, lay.heatY + 34);
    }
  }

  function drawOverlay() {
    const lay = S.layout;
    const canvas = document.getElementById("tracks-overlay");
    const ctx = canvasSize(canvas, document.getElementById("tracks").clientWidth, lay.height);
    const band = (i, fill, stroke) => {
      if (i < 0) return;
      const px = GUTTER + i * S.cw - S.scroll, w = Math.max(S.cw, 2);
      if (px + w < GUTTER || px > GUTTER + plotWidth()) return;
      if (fill) { ctx.fillStyle = fill; ctx.fillRect(px, lay.turnY, w, lay.height - lay.turnY); }
      if (stroke) { ctx.strokeStyle = stroke; ctx.lineWidth = 2; ctx.strokeRect(px, lay.turnY + 1, w, lay.height - lay.turnY - 2); }
    };
    band(S.pinned, "rgba(47,111,219,0.12)", "#2f6fdb");
    if (S.hover !== S.pinned) band(S.hover, "rgba(16,21,31,0.12)", null);
    if (S.hover >= 0 && S.hoverRow >= 0) {
      ctx.strokeStyle = "#10151f";
      ctx.lineWidth = 1;
      ctx.strokeRect(GUTTER, lay.heatY + S.hoverRow * lay.rowH - 0.5, plotWidth(), lay.rowH + 1);
    }
  }

  // ---- the token details and the text around it ----------------------------------------------------------------
  function shown() {
    return S.hover >= 0 ? S.hover : S.pinned;
  }

  function updateDetail() {
    const d = S.d, i = shown();
    setText("detail-pinned", S.pinned >= 0 ? `(pinned: ${S.pinned}; click again to release)` : "(hover the tokens; click to pin)");
    if (i < 0 || i >= d.N) {
      for (const id of ["position", "role", "turn", "id", "piece", "logprob", "topp", "version", "routing"]) setText(`detail-${id}`, "–");
      return;
    }
    const r = d.role[i], j = i - d.P;
    setText("detail-position", `${number(i)} of ${number(d.N)}`);
    setText("detail-role", ROLE_NAMES[r]);
    setText("detail-turn", turnText(d, i));
    setText("detail-id", d.tokens[i]);
    const p = piece(d, i);
    setText("detail-piece", p === undefined ? "(ids only: the gateway has no --tokenizer)" : JSON.stringify(p));
    setText("detail-logprob", r === 0 ? "– (prompt)" : r === 2 ? `${d.logProbs[j]} (not trainable)` : d.logProbs[j].toFixed(6));
    if (r === 0 || !d.topOffsets) {
      setText("detail-topp", d.topOffsets ? "– (prompt)" : "– (no top-p replay)");
    } else {
      const a = d.topOffsets[j], b = d.topOffsets[j + 1];
      const ids = Array.from(d.topIds.subarray(a, Math.min(b, a + TOP_P_SHOWN)));
      setText("detail-topp", `${b - a} ids${b > a ? `: ${ids.join(", ")}${b - a > TOP_P_SHOWN ? ", …" : ""}` : ""}`);
    }
    const v = versionOf(d, i);
    setText("detail-version", v === null ? (r === 1 ? "unknown" : "–") : d.versionTable[v]);
    setText("detail-routing", routingText(d, i));
    updateText(i);
  }

  function routingText(d, i) {
    if (!d.routed) return "– (no routing replay)";
    if (i >= d.R) return `– (no routing row: the session holds ${number(d.R)} rows)`;
    const width = String(d.E - 1).length;
    const lines = [];
    const hoverLayer = S.hoverRow >= 0 ? Math.floor(S.hoverRow / d.K) : -1;
    for (let l = 0; l < d.L; l++) {
      const base = (i * d.L + l) * d.K;
      const experts = Array.from(d.routed.subarray(base, base + d.K), (e) => String(e).padStart(width));
      lines.push(`${l === hoverLayer ? "▶" : " "} layer ${String(l).padStart(2)}: ${experts.join(" ")}`);
    }
    return lines.join("\n");
  }

  function updateText(i) {
    const d = S.d;
    const turn = d.turnOf[i];
    let start = turn < 0 ? 0 : d.turns[turn].start, end = turn < 0 ? d.P : d.turns[turn].end;
    if (end - start > TEXT_WINDOW) {
      start = Math.max(start, i - TEXT_WINDOW / 2);
      end = Math.min(end, start + TEXT_WINDOW);
    }
    const key = `${S.branch}:${start}:${end}`;
    const box = document.getElementById("text");
    if (key !== S.textKey) {
      S.textKey = key;
      const spans = [];
      for (let k = start; k < end; k++) {
        const p = piece(d, k);
        spans.push(el("span", { className: `r${d.role[k]}`, dataset: { i: String(k) } }, p === undefined ? `⟨${d.tokens[k]}⟩ ` : p));
      }
      box.replaceChildren(...spans);
      setText("text-title", `${turn < 0 ? "prompt" : `T${turn + 1}`}, tokens ${number(start)}–${number(end - 1)}`);
    }
    for (const old of box.querySelectorAll("span.sel")) old.classList.remove("sel");
    const current = box.querySelector(`span[data-i="${i}"]`);
    if (current) current.classList.add("sel");
  }

  // ---- the rest of the page ------------------------------------------------------------------------------------
  function branchInfo() {
    // Every branch of the session's tree, the root first (the view's branches[i]: place in the tree, lengths).
    return (S.view.branches || []).map((b) => ({ ...b }));
  }

  const BRANCH_KEYS = ["status", "total_tokens", "turns", "parent", "fork_token", "first_difference", "cause", "drift", "model"];
  const BRANCH_SKIP = new Set(["branch", "busy", "chat", "last_error", "prompt_length", "response_length", "created_at", "updated_at", "trained_versions", ...BRANCH_KEYS]);

  function branchLine(b) {
    const parts = [b.status, `${number(b.total_tokens)} tokens`, `${number(b.turns)} turns`];
    if (b.parent !== undefined && b.parent !== null) parts.push(`parent b${b.parent}`);
    if (b.parent !== undefined && b.parent !== null && b.fork_token !== undefined && b.fork_token !== null) parts.push(`forks at token ${number(b.fork_token)}`);
    if (b.first_difference !== undefined && b.first_difference !== null) parts.push(`first difference at ${JSON.stringify(b.first_difference)}`);
    for (const key of ["cause", "drift"]) if (b[key] !== undefined && b[key] !== null) parts.push(`cause: ${typeof b[key] === "string" ? b[key] : JSON.stringify(b[key])}`);
    if (b.model) parts.push(`model ${b.model}`);
    const trained = b.trained_versions;
    if (trained && trained.count > 1) parts.push(`weights ${trained.first} → ${trained.last} (${trained.count} versions)`);
    for (const [key, value] of Object.entries(b)) {
      if (!BRANCH_SKIP.has(key) && value !== null && value !== undefined) parts.push(`${key}: ${typeof value === "string" ? value : JSON.stringify(value)}`);
    }
    return parts.join(" · ");
  }

  function renderBranches() {
    const nodes = branchInfo();
    const byParent = new Map();
    const known = new Set(nodes.map((b) => b.branch));
    for (const b of nodes) {
      const parent = b.parent !== undefined && b.parent !== null && known.has(b.parent) && b.parent !== b.branch ? b.parent : null;
      if (!byParent.has(parent)) byParent.set(parent, []);
      byParent.get(parent).push(b);
    }
    const seen = new Set();
    const list = (parent) => (byParent.get(parent) || []).filter((b) => !seen.has(b.branch)).map((b) => {
      seen.add(b.branch);
      const button = el("button", {
        type: "button", dataset: { branch: String(b.branch) }, on: { click: () => selectBranch(b.branch) },
      }, `branch ${b.branch}${b.busy ? " · turn running" : ""}`);
      button.setAttribute("aria-current", String(b.branch === S.branch));
      const children = list(b.branch);
      return el("li", {}, button, el("span", { className: "info" }, branchLine(b)), children.length ? el("ul", {}, ...children) : null);
    });
    document.getElementById("branch-tree").replaceChildren(...list(null));
  }

  function renderSummary() {
    const d = S.d, view = S.view;
    const branches = branchInfo();
    setText("count-status", d.meta.status + (view.busy ? " · turn running" : ""));
    const current = branches.find((b) => b.branch === S.branch) || {};
    setText("count-branch", `${S.branch}${current.parent !== undefined && current.parent !== null ? ` (from b${current.parent})` : ""}`);
    setText("count-branches", branches.length);
    setText("count-tokens", number(d.N));
    setText("count-prompt", number(d.P));
    setText("count-trainable", number(d.trainable));
    setText("count-turns", number(d.turns.length));
    setText("lowest", d.minPos >= 0 ? `${d.minLp.toFixed(3)} at ${number(d.minPos)}` : "–");
    setText("count-routing", d.routed ? `${number(d.R)} rows · ${d.L} layers × top-${d.K} · ${d.E} experts seen` : "none");
    setText("count-topp", d.topOffsets ? `${number(d.topIds.length)} ids kept` : "none");
    setText("count-versions", trainedVersionsText(current.trained_versions));
    setText("count-version-spans", d.versionSpans.length
      ? d.versionSpans.map((span) => `${span.name} ${number(span.start)}–${number(span.end - 1)}`).join(" · ") : "–");
    setText("count-error", current.last_error || "none");
    setText("metadata", JSON.stringify(view.metadata || {}));
    const sampleQuery = S.branch === 0 ? "" : `?branch=${S.branch}`;
    document.getElementById("sample-link").href = `/v1/sessions/${encodeURIComponent(sessionId)}/sample${sampleQuery}`;
    document.getElementById("json-link").href = viewPath(S.branch === 0 ? null : S.branch);
  }

  // The versions the trained tokens span, as the gateway sums them up (the view's trained_versions): what a staleness
  // bound looks at.
  function trainedVersionsText(trained) {
    if (!trained || !trained.count) return "–";
    const counts = Object.entries(trained.tokens).map(([name, n]) => `${name}: ${number(n)}`).join(", ");
    const range = trained.count > 1 ? `${trained.first} → ${trained.last}` : trained.first;
    return `${range} (${trained.count} version${trained.count > 1 ? "s" : ""}; trained tokens ${counts})`;
  }

  function renderLegends() {
    const d = S.d;
    const items = [];
    if (d.versionTable.length) {
      items.push(el("span", {}, "weight versions: "));
      d.versionTable.forEach((name, v) => {
        const swatch = el("i", { className: "sw" });
        swatch.style.background = VERSION_COLOURS[v % VERSION_COLOURS.length];
        items.push(el("span", {}, swatch, ` ${name}`));
      });
    }
    if (d.routed) {
      const bar = el("canvas", { width: Math.min(256, d.E * 4), height: 12 });
      const ctx = bar.getContext("2d");
      const w = bar.width / d.E;
      for (let e = 0; e < d.E; e++) { ctx.fillStyle = d.palette.css[e]; ctx.fillRect(e * w, 0, Math.ceil(w), 12); }
      items.push(el("span", {}, "experts: 0 ", bar, ` ${d.E - 1}`));
    }
    document.getElementById("legends").replaceChildren(...items);
  }

  function drawHistograms() {
    const d = S.d;
    const canvas = document.getElementById("histograms");
    document.getElementById("no-routing").hidden = Boolean(d.routed);
    canvas.hidden = !d.routed;
    if (!d.routed) return;
    const width = canvas.parentElement.clientWidth - 28;
    const cols = Math.max(1, Math.floor(width / 150)), cellW = width / cols, cellH = 66;
    const rows = Math.ceil(d.L / cols);
    const ctx = canvasSize(canvas, width, rows * cellH);
    const even = (d.R * d.K) / d.E;
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "top";
    for (let l = 0; l < d.L; l++) {
      const x0 = (l % cols) * cellW + 4, y0 = Math.floor(l / cols) * cellH + 2, w = cellW - 12, h = cellH - 18;
      let max = 1;
      for (let e = 0; e < d.E; e++) max = Math.max(max, d.load[l * d.E + e]);
      const barW = w / d.E;
      for (let e = 0; e < d.E; e++) {
        const bh = (d.load[l * d.E + e] / max) * h;
        ctx.fillStyle = d.palette.css[e];
        ctx.fillRect(x0 + e * barW, y0 + 14 + h - bh, Math.max(1, barW - (barW > 3 ? 1 : 0)), bh);
      }
      ctx.strokeStyle = "#10151f";
      ctx.setLineDash([3, 2]);
      ctx.beginPath();
      const ey = y0 + 14 + h - (even / max) * h + 0.5;
      ctx.moveTo(x0, ey);
      ctx.lineTo(x0 + w, ey);
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = "#3b4456";
      ctx.fillText(`layer ${l} · max ${number(max)}`, x0, y0);
    }
    canvas.onmousemove = (event) => {
      const rect = canvas.getBoundingClientRect();
      const cx = event.clientX - rect.left, cy = event.clientY - rect.top;
      const l = Math.floor(cy / cellH) * cols + Math.floor(cx / cellW);
      const e = Math.floor(((cx % cellW) - 4) / ((cellW - 12) / d.E));
      canvas.title = l < d.L && e >= 0 && e < d.E ? `layer ${l}, expert ${e}: ${number(d.load[l * d.E + e])} of ${number(d.R * d.K)}` : "";
    };
  }

  function renderChat() {
    const chat = S.view.chat;
    const panel = document.getElementById("chat-panel");
    panel.hidden = !chat || !chat.messages || !chat.messages.length;
    if (panel.hidden) return;
    const items = chat.messages.map((m) => el("li", {},
      el("span", { className: "role" }, m.role),
      el("span", { className: "content" }, typeof m.content === "string" ? m.content : JSON.stringify(m.content)),
      m.tool_calls ? el("div", { className: "calls" }, m.tool_calls.map((c) => `${c.name}(${typeof c.arguments === "string" ? c.arguments : JSON.stringify(c.arguments)})`).join("; ")) : null,
    ));
    document.getElementById("chat").replaceChildren(...items);
  }

  // ---- events ------------------------------------------------------------------------------------------------
  function tokenAt(event) {
    const rect = document.getElementById("tracks").getBoundingClientRect();
    const px = event.clientX - rect.left, py = event.clientY - rect.top;
    if (px < GUTTER) return { i: -1, row: -1 };
    const i = Math.floor((S.scroll + px - GUTTER) / S.cw);
    const lay = S.layout;
    const row = lay.rows && py >= lay.heatY && py < lay.heatY + lay.heatH ? Math.floor((py - lay.heatY) / lay.rowH) : -1;
    return { i: i >= 0 && i < S.d.N ? i : -1, row };
  }

  function hover(i, row) {
    if (i === S.hover && row === S.hoverRow) return;
    S.hover = i;
    S.hoverRow = row;
    updateDetail();
    drawOverlay();
  }

  function pin(i, reveal) {
    S.pinned = S.pinned === i ? -1 : i;
    if (reveal && S.pinned >= 0) {
      const px = S.pinned * S.cw;
      if (px < S.scroll || px > S.scroll + plotWidth() - S.cw) scrollTo(px - plotWidth() / 2);
    }
    updateDetail();
    drawOverlay();
  }

  function wireEvents() {
    const tracks = document.getElementById("tracks");
    tracks.addEventListener("mousemove", (event) => { const at = tokenAt(event); hover(at.i, at.row); });
    tracks.addEventListener("mouseleave", () => hover(-1, -1));
    tracks.addEventListener("click", (event) => { const at = tokenAt(event); if (at.i >= 0) pin(at.i, false); });
    tracks.addEventListener("wheel", (event) => {
      event.preventDefault();
      if (event.ctrlKey) {
        const at = tokenAt(event);
        const levels = ["1", "2", "4", "8", "16", "32", "64"];
        const current = S.zoom === "fit" ? -1 : levels.indexOf(S.zoom);
        const next = Math.max(-1, Math.min(levels.length - 1, current + (event.deltaY < 0 ? 1 : -1)));
        setZoom(next < 0 ? "fit" : levels[next], at.i >= 0 ? at.i : undefined);
        return;
      }
      scrollTo(S.scroll + (Math.abs(event.deltaX) > Math.abs(event.deltaY) ? event.deltaX : event.deltaY));
    }, { passive: false });
    document.getElementById("hscroll").addEventListener("scroll", (event) => {
      S.scroll = event.target.scrollLeft;
      queueDraw();
    });
    document.getElementById("zoom").addEventListener("change", (event) => setZoom(event.target.value));
    document.getElementById("lowest").addEventListener("click", () => { if (S.d.minPos >= 0) { S.pinned = -1; pin(S.d.minPos, true); } });
    const text = document.getElementById("text");
    text.addEventListener("click", (event) => {
      const i = event.target.dataset && event.target.dataset.i;
      if (i !== undefined) pin(parseInt(i, 10), true);
    });
    window.addEventListener("resize", () => { if (S.d) { setZoom(S.zoom); drawHistograms(); } });
  }

  // ---- loading -------------------------------------------------------------------------------------------------
  function viewPath(branch) {
    const query = branch === null || branch === undefined ? "" : `?branch=${branch}`;
    return `/v1/sessions/${encodeURIComponent(sessionId)}${query}`;
  }

  async function fetchBranch(branch) {
    const started = performance.now();
    const query = branch === null || branch === undefined ? "" : `?branch=${branch}`;
    const buffer = await api(`/ui/api/sessions/${encodeURIComponent(sessionId)}/data${query}`, { binary: true });
    timings.fetch_ms = performance.now() - started;
    return buffer;
  }

  async function loadBranch(branch, pending) {
    const started = performance.now();
    const buffer = await (pending || fetchBranch(branch));
    const fetched = performance.now();
    const parsed = parseSafetensors(buffer);
    const parsedAt = performance.now();
    const d = derive(parsed);
    const derivedAt = performance.now();
    S.d = d;
    S.branch = parseInt(parsed.meta.branch, 10);
    S.layout = layout(d);
    S.hover = -1; S.hoverRow = -1; S.pinned = -1; S.textKey = null;
    document.body.dataset.branch = String(S.branch);
    renderSummary();
    renderBranches();
    renderLegends();
    setZoom(S.zoom, 0);
    drawTracks();
    drawOverlay();
    drawHistograms();
    updateDetail();
    const firstModelTurn = d.turns.find((turn) => turn.kind === "model" && turn.end > turn.start);
    updateText(firstModelTurn ? firstModelTurn.start : 0);
    const drawn = performance.now();
    Object.assign(timings, {
      bytes: buffer.byteLength, parse_ms: parsedAt - fetched,
      derive_ms: derivedAt - parsedAt, draw_ms: drawn - derivedAt, load_ms: drawn - started,
    });
  }

  async function selectBranch(branch) {
    if (branch === S.branch) return;
    document.body.dataset.ready = "0";
    const url = new URL(window.location.href);
    url.searchParams.set("branch", String(branch));
    window.history.replaceState(null, "", url);
    try {
      const data = fetchBranch(branch); // both requests at once
      data.catch(() => {});
      S.view = await api(viewPath(branch)); // that branch's chat record
      renderChat();
      await loadBranch(branch, data);
      document.body.dataset.ready = "1";
    } catch (exc) {
      showError(exc);
    }
  }

  function showError(exc) {
    setText("load-error", String(exc.message || exc));
    document.body.dataset.ready = "error";
  }

  async function load() {
    setText("session-id", sessionId);
    document.title = `${sessionId} · slime-gateway inspector`;
    const wanted = new URLSearchParams(window.location.search).get("branch");
    const branch = wanted === null ? null : parseInt(wanted, 10);
    const data = fetchBranch(branch); // both requests at once
    data.catch(() => {}); // awaited below; a failure there is reported once
    S.view = await api(viewPath(branch));
    document.getElementById("inspector").hidden = false;
    renderChat();
    await loadBranch(branch, data);
    timings.ready_ms = performance.now(); // since the navigation started: the page's whole render time
    document.body.dataset.ready = "1";
  }

  wireEvents();
  withLogin(load, showError);
})();
