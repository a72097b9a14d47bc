// The request fields both tabs share, built from the served models' cards (their `gouache`
// defaults). Nothing is checked here: the API's own errors are what the user sees.

const FIELDS = [
  { name: "prompt", label: "Prompt", kind: "textarea", rows: 3, wide: true },
  { name: "negative_prompt", label: "Negative prompt", kind: "textarea", rows: 2, wide: true },
  { name: "model", label: "Model", kind: "select" },
  { name: "width", label: "Width" },
  { name: "height", label: "Height" },
  { name: "num_inference_steps", label: "Steps" },
  { name: "guidance_scale", label: "Guidance", step: "any" },
  { name: "seed", label: "Seed", placeholder: "random" },
  { name: "n", label: "Images", value: 1 },
  { name: "partial_images", label: "Previews", value: 2, title: "previews per image while it denoises (0-3)" },
  { name: "service_tier", label: "Tier", kind: "select", options: ["auto", "priority", "default", "flex"],
    title: "service tier: priority goes first (and pauses lower tiers), flex runs on spare capacity; auto: your key's" },
];

// Optional numbers (`optionalNumbers`): left empty, the server's default applies.
const OPTIONAL = ["num_inference_steps", "guidance_scale", "seed"];

export function field(spec) {
  const label = document.createElement("label");
  label.textContent = spec.label + " ";
  if (spec.wide) label.className = "wide";
  const input = document.createElement(spec.kind ?? "input");
  input.name = spec.name;
  if (!spec.kind) {
    input.type = "number";
    input.step = spec.step ?? "1";
  }
  if (spec.file) Object.assign(input, { type: "file", accept: "image/png,image/jpeg,image/webp" });
  if (spec.rows) input.rows = spec.rows;
  for (const option of spec.options ?? []) input.add(new Option(option, option));
  if (spec.placeholder) input.placeholder = spec.placeholder;
  if (spec.value !== undefined) input.value = spec.value;
  if (spec.title) label.title = spec.title;
  label.append(input);
  return label;
}

export function buildFields(form, fields = FIELDS) {
  form.querySelector(".fields").append(...fields.map(field));
}

// Fill the fields' defaults from the model cards of GET /v1/models.
export function applyModels(form, models) {
  const select = form.elements.model;
  select.replaceChildren(...models.map((card) => new Option(card.id, card.id)));
  const defaults = models[0].gouache;
  const [width, height] = defaults.sizes ? defaults.sizes[0].split("x") : [defaults.default_size, defaults.default_size];
  form.elements.width.value ||= width;
  form.elements.height.value ||= height;
  form.elements.width.step = form.elements.height.step = defaults.size_step;
  form.elements.num_inference_steps.placeholder = `${defaults.default_steps}`;
  form.elements.guidance_scale.placeholder = `${defaults.default_guidance}`;
  if (form.elements.n) form.elements.n.max = defaults.max_n;
  form.elements.negative_prompt.placeholder = defaults.uses_cfg ? "" : "this model does not use guidance";
  if (form.elements.strength) { // the edit tab: img2img where the model takes it
    form.elements.strength.disabled = !defaults.kinds.img2img;
    form.elements.strength.placeholder = defaults.kinds.img2img ? "off" : "this model takes a mask only";
  }
  if (form.elements.input_reference) { // the video tab: a first frame where the model makes clips from one
    form.elements.input_reference.closest("label").hidden = !defaults.kinds.video?.from_image;
  }
  if (form.elements.references) { // the edit tab: further images where the model takes several
    const more = defaults.kinds.max_input_images - 1;
    form.querySelector(".references").hidden = more < 1;
    form.elements.references.title = `up to ${more} more`;
  }
}

// The LoRAs of --lora-dir and ControlNets of --controlnet-dir (GET /v1/loras, /v1/controlnets):
// a row each (use it, its scale, a ControlNet's conditioning image), shown when there are any.
export function applyAdapters(form, loras, controlnets) {
  const box = form.querySelector(".adapters");
  box.replaceChildren(...loras.map((card) => adapterRow("lora", card.id)),
    ...controlnets.map((card) => adapterRow("controlnet", card.id)));
  box.hidden = box.children.length === 0;
}

function adapterRow(kind, name) {
  const row = document.createElement("div");
  row.className = "adapter";
  row.dataset.kind = kind;
  row.dataset.name = name;
  const use = Object.assign(document.createElement("input"), { type: "checkbox", className: "use" });
  const title = document.createElement("label");
  title.append(use, ` ${kind === "lora" ? "LoRA" : "ControlNet"} ${name}`);
  const scale = field({ name: `${kind}-${name}-scale`, label: "Scale", value: 1, step: "any" });
  scale.querySelector("input").className = "scale";
  row.append(title, scale);
  if (kind === "controlnet") {
    const image = field({ name: `${kind}-${name}-image`, label: "Conditioning image (the image's size)", kind: "input",
      file: true });
    image.querySelector("input").className = "image";
    row.append(image);
  }
  return row;
}

export const dataUrl = (file) => new Promise((resolve, reject) => {
  const reader = new FileReader();
  reader.onload = () => resolve(reader.result);
  reader.onerror = () => reject(reader.error);
  reader.readAsDataURL(file);
});

// The `loras` and `controlnets` of the rows in use.
async function readAdapters(form) {
  const loras = [];
  const controlnets = [];
  for (const row of form.querySelectorAll(".adapter")) {
    if (!row.querySelector(".use").checked) continue;
    const scale = number(row.querySelector(".scale").value);
    if (row.dataset.kind === "lora") {
      loras.push({ name: row.dataset.name, scale });
    } else {
      const [file] = row.querySelector(".image").files;
      controlnets.push({ name: row.dataset.name, scale, image: file ? await dataUrl(file) : "" });
    }
  }
  return { loras, controlnets };
}

export const number = (value) => (value.trim() === "" || Number.isNaN(Number(value)) ? value : Number(value));

// The optional numbers `names` of the fields `f` that are filled in, into `body` (left empty, the
// server's default applies).
export function optionalNumbers(body, f, names) {
  for (const name of names) {
    if (f[name].value.trim()) body[name] = number(f[name].value);
  }
}

// The request body the fields describe (always streamed).
export async function readParams(form) {
  const f = form.elements;
  const body = {
    prompt: f.prompt.value,
    model: f.model.value,
    size: `${f.width.value}x${f.height.value}`,
    n: number(f.n.value),
    stream: true,
    partial_images: number(f.partial_images.value),
  };
  if (f.negative_prompt.value.trim()) body.negative_prompt = f.negative_prompt.value;
  if (f.service_tier.value !== "auto") body.service_tier = f.service_tier.value;
  optionalNumbers(body, f, OPTIONAL);
  const { loras, controlnets } = await readAdapters(form);
  if (loras.length) body.loras = loras;
  if (controlnets.length) body.controlnets = controlnets;
  return body;
}
