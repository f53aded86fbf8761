// Reference encoder for the differential test and the speed comparison:
// Hugging Face tokenizers (Rust, through the @anush008/tokenizers binding).
//
//   node hf_reference.js NODE_MODULES TOKENIZER_JSON TEXTS_JSON encode
//     prints {"plain": [[ids]...], "special": [[ids]...], "decoded": [str...]}
//     (add_special_tokens false, then true; decoded = decode(plain ids,
//     skip_special_tokens=false))
//   node hf_reference.js NODE_MODULES TOKENIZER_JSON TEXTS_JSON encode transformers
//     the same, but "special" with the post-processor Python transformers
//     (what vLLM loads) installs for this tokenizer: see
//     transformersProcessor
//   node hf_reference.js NODE_MODULES TOKENIZER_JSON TEXTS_JSON bench REPS
//     prints {"seconds": best time of one pass over all texts, "tokens": N}
//
// Run with TOKENIZERS_PARALLELISM=false so that encodeBatch stays on one
// thread.
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const [modules, tokPath, textsPath, mode, arg] = process.argv.slice(2);
  const hf = require(path.resolve(modules, '@anush008', 'tokenizers'));
  const tok = hf.Tokenizer.fromFile(tokPath);
  const texts = JSON.parse(fs.readFileSync(textsPath, 'utf8'));
  const ids = (encs) => encs.map((e) => Array.from(e.getIds()));
  if (mode === 'encode') {
    const plain = ids(await tok.encodeBatch(texts, { addSpecialTokens: false }));
    if (arg === 'transformers') {
      const proc = transformersProcessor(hf, tok, tokPath);
      if (proc) tok.setPostProcessor(proc);
    } else if (arg !== undefined) {
      throw new Error('unknown encode option ' + arg);
    }
    const special = ids(await tok.encodeBatch(texts, { addSpecialTokens: true }));
    const decoded = await tok.decodeBatch(plain, false);
    process.stdout.write(JSON.stringify({ plain, special, decoded }));
    return;
  }
  if (mode === 'bench') {
    const reps = Number(arg || 3);
    let best = Infinity;
    let tokens = 0;
    for (let r = 0; r < reps; r++) {
      const t0 = process.hrtime.bigint();
      const encs = await tok.encodeBatch(texts, { addSpecialTokens: false });
      const dt = Number(process.hrtime.bigint() - t0) / 1e9;
      best = Math.min(best, dt);
      tokens = encs.reduce((n, e) => n + e.getIds().length, 0);
    }
    process.stdout.write(JSON.stringify({ seconds: best, tokens }));
    return;
  }
  throw new Error('unknown mode ' + mode);
}

// transformersProcessor is the post-processor Python transformers puts in
// place of tokenizer.json's when it loads this tokenizer, or null when it
// keeps tokenizer.json's. LlamaTokenizerFast, CodeLlamaTokenizerFast and
// GemmaTokenizerFast (transformers/models/llama/tokenization_llama_fast.py
// and its siblings, transformers 4.x) call update_post_processor() in
// __init__, which builds, from tokenizer_config.json's add_bos_token
// (default true) and add_eos_token (default false):
//
//   single = f"{(bos + ':0 ') if self.add_bos_token else ''}$A:0{(' ' + eos + ':0') if self.add_eos_token else ''}"
//   pair = f"{single}{(' ' + bos + ':1') if self.add_bos_token else ''} $B:1{(' ' + eos + ':1') if self.add_eos_token else ''}"
//   processors.TemplateProcessing(single=single, pair=pair, special_tokens=[(bos, bos_id)?, (eos, eos_id)?])
//
// The same TemplateProcessing is built here with HF tokenizers' own
// constructor, so HF tokenizers, not our code, applies it. (transformers.js
// keeps tokenizer.json's post-processor: DeepSeek V3, whose tokenizer.json
// adds no BOS but whose config says LlamaTokenizerFast + add_bos_token,
// gets BOS from Python transformers and vLLM, none from transformers.js.)
function transformersProcessor(hf, tok, tokPath) {
  const cfgPath = path.join(path.dirname(tokPath), 'tokenizer_config.json');
  if (!fs.existsSync(cfgPath)) return null;
  const cfg = JSON.parse(fs.readFileSync(cfgPath, 'utf8'));
  const cls = String(cfg.tokenizer_class || '').replace(/Fast$/, '');
  if (!['LlamaTokenizer', 'CodeLlamaTokenizer', 'GemmaTokenizer'].includes(cls)) return null;
  const addBos = cfg.add_bos_token ?? true;
  const addEos = cfg.add_eos_token ?? false;
  const content = (t) => (t && typeof t === 'object' ? t.content : t);
  const bos = content(cfg.bos_token);
  const eos = content(cfg.eos_token);
  if (addBos && bos == null) throw new Error('add_bos_token = True but bos_token = None');
  if (addEos && eos == null) throw new Error('add_eos_token = True but eos_token = None');
  const single = `${addBos ? bos + ':0 ' : ''}$A:0${addEos ? ' ' + eos + ':0' : ''}`;
  const pair = `${single}${addBos ? ' ' + bos + ':1' : ''} $B:1${addEos ? ' ' + eos + ':1' : ''}`;
  const special = [];
  if (addBos) special.push([bos, tok.tokenToId(bos)]);
  if (addEos) special.push([eos, tok.tokenToId(eos)]);
  return hf.templateProcessing(single, pair, special);
}

main().catch((err) => {
  process.stderr.write(String(err && err.stack || err) + '\n');
  process.exit(1);
});
