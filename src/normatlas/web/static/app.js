// The single page's router: the view named in the URL hash renders into <main>; every view keeps its
// state in the hash, so each can be linked.
import * as axes from "./axes.js";
import * as experiments from "./experiments.js";
import * as geometry from "./geometry.js";
import * as inspect from "./inspect.js";
import * as matrix from "./matrix.js";
import * as papers from "./papers.js";
import * as placements from "./placements.js";
import * as tools from "./tools.js";
import {mount, readHash, status} from "./util.js";

const VIEWS = {axes, placements, matrix, papers, inspect, tools, experiments, geometry};

// views rewrite their own parameters with history.replaceState, which fires no hashchange: a hashchange
// is always the reader navigating (a link, back / forward), so it always renders
async function route() {
  const {view, params} = readHash();
  const name = view in VIEWS ? view : "axes";
  const main = document.getElementById("main");
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.view === name) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  main.dataset.view = name;
  delete main.dataset.ready;
  try {
    await VIEWS[name].render(main, params);
    main.dataset.ready = "1";
  } catch (e) {
    mount(main, status(`could not render ${name}: ${e.message}`, "error"));
    console.error(e);
  }
  document.title = `${name} · normatlas`;
}

addEventListener("hashchange", route);
route();
