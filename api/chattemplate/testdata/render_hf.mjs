// Reference renderer for the chattemplate differential test: Hugging Face's
// own JavaScript implementation, transformers.js's
// PreTrainedTokenizer.apply_chat_template (@huggingface/transformers) on
// @huggingface/jinja's Template, with the tokenizer (and so the special
// tokens the template sees) loaded by transformers.js's AutoTokenizer from
// the model's local tokenizer.json/tokenizer_config.json, never the network.
//
//   TZ=UTC node render_hf.mjs NODE_MODULES < request.json > results.json
//
// Input (stdin, JSON): {"now": "YYYY-MM-DDTHH:MM:SS",
//                       "templates": {name: source},
//                       "model_dirs": {name: dir with tokenizer.json},
//                       "cases": [{"template": name, "vars": {...},
//                                  "continue_final_message": bool}]}
// "vars" are the request's template variables without the special tokens:
// apply_chat_template adds those itself. Output (stdout, JSON): one entry per
// case, in order: {"out": rendered} or {"error": message}, or
// {"unsupported": why} where transformers.js has no counterpart
// (continue_final_message: its apply_chat_template has no such option).
// strftime_now reads the clock through `new Date()`: the clock is fixed to
// "now" (UTC) here, as on the other sides.
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';

const modules = process.argv[2];
if (!modules) throw new Error('usage: node render_hf.mjs NODE_MODULES < request.json');
const require = createRequire(path.join(path.resolve(modules), 'noop.js'));
const { env, AutoTokenizer } = require('@huggingface/transformers');

const req = JSON.parse(fs.readFileSync(0, 'utf8'));

const RealDate = Date;
const fixed = RealDate.parse(req.now + 'Z');
globalThis.Date = class extends RealDate {
  constructor(...args) {
    if (args.length === 0) super(fixed);
    else super(...args);
  }
  static now() {
    return fixed;
  }
};

env.allowRemoteModels = false;
env.allowLocalModels = true;

const tokenizers = {};
async function tokenizerFor(name) {
  if (!(name in tokenizers)) {
    // A model id of two path elements under localModelPath: ids must be
    // relative, and distinct across families.
    const dir = path.resolve(req.model_dirs[name]);
    env.localModelPath = path.dirname(path.dirname(dir)) + '/';
    const id = path.basename(path.dirname(dir)) + '/' + path.basename(dir);
    tokenizers[name] = await AutoTokenizer.from_pretrained(id, { local_files_only: true });
  }
  return tokenizers[name];
}

const results = [];
for (const c of req.cases) {
  if (c.continue_final_message) {
    results.push({ unsupported: 'transformers.js apply_chat_template has no continue_final_message' });
    continue;
  }
  try {
    const tok = await tokenizerFor(c.template);
    const { messages, tools = null, documents = null, add_generation_prompt = false, ...rest } = c.vars;
    const out = tok.apply_chat_template(messages, {
      chat_template: req.templates[c.template],
      tokenize: false,
      add_generation_prompt,
      tools,
      documents,
      ...rest,
    });
    results.push({ out });
  } catch (e) {
    results.push({ error: String((e && e.message) || e) });
  }
}
process.stdout.write(JSON.stringify(results));
