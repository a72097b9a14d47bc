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
];

// Optional numbers: left empty, the server's default applies.
const OPTIONAL = ["num_inference_steps", "guidance_scale", "seed"];

function field(spec) {
  const label = document.createElement("label");
  label.textContent = spec.label + " ";
  if (spec.wide) label.className = "wide";
  const input = document.createElement(spec.kind ?? "input");
  input.name = spec.name;
  if (!spec.kind) {
    input.type = "number";
    input.step = spec.step ?? "1";
  }
  if (spec.rows) input.rows = spec.rows;
  if (spec.placeholder) input.placeholder = spec.placeholder;
  if (spec.value !== undefined) input.value = spec.value;
  if (spec.title) label.title = spec.title;
  label.append(input);
  return label;
}

export function buildFields(form) {
  form.querySelector(".fields").append(...FIELDS.map(field));
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
  form.elements.n.max = defaults.max_n;
  form.elements.negative_prompt.placeholder = defaults.uses_cfg ? "" : "this model does not use guidance";
}

const number = (value) => (value.trim() === "" || Number.isNaN(Number(value)) ? value : Number(value));

// The request body the fields describe (always streamed).
export function readParams(form) {
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
  for (const name of OPTIONAL) {
    if (f[name].value.trim()) body[name] = number(f[name].value);
  }
  return body;
}
