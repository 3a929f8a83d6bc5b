// A small SVG line chart for the dashboard and the demo: built with DOM
// calls only (no markup strings), so no value can inject anything.

const NS = "http://www.w3.org/2000/svg";
const WIDTH = 480;
const HEIGHT = 220;
const PAD = { left: 46, right: 12, top: 14, bottom: 30 };

function el(name, attributes, text) {
  const node = document.createElementNS(NS, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (step * magnitude >= value) return step * magnitude;
  }
  return 10 * magnitude;
}

/**
 * Draws `series` ([{name, description?, points: [[x, y], ...]}]) into
 * `container`, replacing what was there. Options: xLabel, yMax (fixed top
 * of the y axis), legend (a list under the chart naming each line, with
 * its description, instead of the names inside the plot).
 */
export function lineChart(container, series, options = {}) {
  const svg = el("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img" });
  const all = series.flatMap((s) => s.points).filter(([, y]) => Number.isFinite(y));
  const plotW = WIDTH - PAD.left - PAD.right;
  const plotH = HEIGHT - PAD.top - PAD.bottom;
  if (all.length === 0) {
    svg.append(el("text", { x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle", class: "empty" }, "no rounds yet"));
    container.replaceChildren(svg);
    return svg;
  }
  const xs = all.map(([x]) => x);
  const xMin = Math.min(...xs);
  const xMax = Math.max(...xs, xMin + 1);
  const yMax = options.yMax ?? niceMax(Math.max(...all.map(([, y]) => y)));
  const px = (x) => PAD.left + ((x - xMin) / (xMax - xMin)) * plotW;
  const py = (y) => PAD.top + plotH - (Math.min(Math.max(y, 0), yMax) / yMax) * plotH;
  for (let i = 0; i <= 4; i++) {
    const y = (yMax * i) / 4;
    svg.append(el("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: py(y), y2: py(y), class: "grid" }));
    svg.append(el("text", { x: PAD.left - 6, y: py(y) + 4, "text-anchor": "end" }, +y.toFixed(3)));
  }
  svg.append(el("line", { x1: PAD.left, x2: PAD.left, y1: PAD.top, y2: PAD.top + plotH, class: "axis" }));
  svg.append(el("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: PAD.top + plotH, y2: PAD.top + plotH, class: "axis" }));
  const ticks = [...new Set(xs)].sort((a, b) => a - b);
  const every = Math.ceil(ticks.length / 10);
  ticks.forEach((x, i) => {
    if (i % every === 0) svg.append(el("text", { x: px(x), y: HEIGHT - 12, "text-anchor": "middle" }, x));
  });
  if (options.xLabel) {
    svg.append(el("text", { x: WIDTH - PAD.right, y: HEIGHT - 1, "text-anchor": "end" }, options.xLabel));
  }
  series.forEach((s, index) => {
    const points = s.points.filter(([, y]) => Number.isFinite(y));
    if (points.length === 0) return;
    const group = el("g", { class: `series series-${index}`, "data-series": s.name });
    group.append(el("polyline", { points: points.map(([x, y]) => `${px(x)},${py(y)}`).join(" ") }));
    for (const [x, y] of points) {
      const dot = el("circle", { cx: px(x), cy: py(y), r: 3, "data-x": x, "data-y": y });
      dot.append(el("title", {}, `${s.name}, round ${x}: ${+y.toFixed(4)}`));
      group.append(dot);
    }
    svg.append(group);
    if (!options.legend) {
      svg.append(el("text", { x: PAD.left + 8 + index * 150, y: PAD.top + 10, class: `series-${index}`, stroke: "none" }, s.name));
    }
  });
  container.replaceChildren(svg);
  if (options.legend) container.append(legend(series));
  return svg;
}

/** A list naming each series beside a swatch of its colour. */
function legend(series) {
  const list = document.createElement("ul");
  list.className = "legend";
  series.forEach((s, index) => {
    const item = document.createElement("li");
    item.dataset.series = s.name;
    const swatch = document.createElement("span");
    swatch.className = `swatch series-${index}`;
    const name = document.createElement("strong");
    name.textContent = s.name;
    item.append(swatch, name);
    if (s.description) item.append(`: ${s.description}`);
    list.append(item);
  });
  return list;
}
