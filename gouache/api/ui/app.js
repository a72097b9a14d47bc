// The playground: tabs, the API key, the served models, and the tabs' wiring.

import { getJson, keyRequired, savedKey, saveKey } from "./api.js";
import { MaskPainter, editForm } from "./edit.js";
import { applyAdapters, applyModels, buildFields, readParams } from "./form.js";
import { imageTab, showError } from "./results.js";
import { statusTab } from "./status.js";
import { VIDEO_FIELDS, videoTab } from "./video.js";

const keyForm = document.getElementById("key-form");
const serverLine = document.getElementById("server-line");
const generateTab = document.getElementById("tab-generate");
const editTab = document.getElementById("tab-edit");
const generateFields = generateTab.querySelector("form");
const editFields = editTab.querySelector("form");
const videoFields = document.getElementById("video-form");
const status = statusTab(document.getElementById("tab-status"), askForKey);
let models = null; // the cards of GET /v1/models, once read
let shown = "generate"; // the selected tab
const allowed = () => !keyRequired() || savedKey() !== null; // may the page call the API yet?

function askForKey(error) {
  keyForm.hidden = false;
  const line = keyForm.querySelector(".error");
  if (error) showError(line, error);
  else line.hidden = true;
  keyForm.elements.key.focus();
}

// Read the model cards and the adapters (the first calls that need the key, when the server
// wants one).
async function connect() {
  let loras, controlnets;
  try {
    models = (await getJson("/v1/models")).data;
    [loras, controlnets] = await Promise.all(["/v1/loras", "/v1/controlnets"].map(async (path) => (await getJson(path)).data));
  } catch (error) {
    if (error.status === 401) askForKey(error);
    else serverLine.textContent = error.message;
    return;
  }
  keyForm.hidden = true;
  const clips = models.filter((card) => card.gouache.kinds.video); // video models: the Video tab's
  const images = models.filter((card) => !card.gouache.kinds.video);
  if (!generateFields.elements.model.options.length && !videoFields.elements.model.options.length) {
    // the first time: the forms keep what was chosen
    for (const form of images.length ? [generateFields, editFields] : []) {
      applyModels(form, images);
      applyAdapters(form, loras, controlnets);
    }
    if (clips.length) applyModels(videoFields, clips);
  }
  for (const name of ["generate", "edit"]) tabButton(name).hidden = !images.length;
  tabButton("video").hidden = !clips.length;
  if (shown === "status") status.show();
  // a server of models that only edit (shapes-edit) opens on the Edit tab, one of video models on
  // the Video tab, unless the address named one
  if (!tabNamed && !images.length) select("video");
  else if (!tabNamed && images.every((card) => !card.gouache.kinds.generation)) select("edit");
  serverLine.textContent = `serving ${models.map((card) => card.id).join(", ")}`;
}

const tabButton = (name) => document.querySelector(`[data-tab="${name}"]`);

function select(name) {
  shown = name;
  for (const button of document.querySelectorAll("[data-tab]")) button.setAttribute("aria-selected", button.dataset.tab === name);
  for (const section of document.querySelectorAll(".tab")) section.hidden = section.id !== `tab-${name}`;
  if (name === "status" && allowed()) status.show();
  else status.hide();
  history.replaceState(null, "", `#${name}`);
}

keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  saveKey(keyForm.elements.key.value.trim());
  connect();
});

for (const form of [generateFields, editFields]) buildFields(form);
buildFields(videoFields, VIDEO_FIELDS);
videoTab(document.getElementById("tab-video"), askForKey);
imageTab(generateTab, async () => {
  const body = await readParams(generateFields);
  return ["/v1/images/generations", body, body];
}, askForKey);

// An edit's size starts as the upload's: scaled down to fit the model's bounds, then down to its
// size step; on a server that prices only some sizes, the one closest in shape. (Any other
// size resizes the upload; where a size is refused, the API says why.)
function startingSize({ width, height }) {
  if (!models) return [width, height];
  const { size_step: step, min_size: least, max_size: most, max_pixels: pixels, sizes } = models[0].gouache;
  if (sizes) {
    const skew = (size) => {
      const [w, h] = size.split("x").map(Number);
      return Math.abs(Math.log(w / h / (width / height)));
    };
    return [...sizes].sort((a, b) => skew(a) - skew(b))[0].split("x").map(Number);
  }
  const scale = Math.min(1, most / width, most / height, Math.sqrt(pixels / (width * height)));
  return [width, height].map((side) => Math.max(Math.ceil(least / step) * step, Math.floor((side * scale) / step) * step));
}

const painter = new MaskPainter(editFields);
editFields.elements.image.addEventListener("change", async () => {
  const [file] = editFields.elements.image.files;
  if (!file) return;
  const errorLine = editTab.querySelector(":scope > .error");
  errorLine.hidden = true;
  try {
    const [width, height] = startingSize(await painter.load(file));
    editFields.elements.width.value = width;
    editFields.elements.height.value = height;
  } catch {
    showError(errorLine, new Error(`This browser cannot read ${file.name} as an image; choose a PNG, JPEG or WebP file.`));
  }
});
imageTab(editTab, async () => {
  const params = await readParams(editFields);
  const strength = editFields.elements.strength.value.trim();
  if (strength) params.strength = Number.isNaN(Number(strength)) ? strength : Number(strength);
  const card = models?.find((model) => model.id === params.model);
  const takesSeveral = (card?.gouache.kinds.max_input_images ?? 1) > 1;
  const references = takesSeveral ? [...editFields.elements.references.files] : [];
  return ["/v1/images/edits", await editForm(painter, params, Boolean(card?.gouache.kinds.instruction_edit), references),
    params];
}, askForKey);

for (const button of document.querySelectorAll("[data-tab]")) button.addEventListener("click", () => select(button.dataset.tab));
const TABS = ["generate", "edit", "video", "status"];
const tabNamed = TABS.includes(location.hash.slice(1)); // as the page was opened, before a tab is shown
const fromHash = () => select(TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "generate");
window.addEventListener("hashchange", fromHash);
fromHash();
if (allowed()) connect();
else askForKey();
