// Reference encoder for the differential test and the speed comparison:
// Hugging Face tokenizers (Rust, through the @anush008/tokenizers binding).
//
//   node hf_reference.js NODE_MODULES TOKENIZER_JSON TEXTS_JSON encode
//     prints {"plain": [[ids]...], "special": [[ids]...], "decoded": [str...]}
//     (add_special_tokens false, then true; decoded = decode(plain ids,
//     skip_special_tokens=false))
//   node hf_reference.js NODE_MODULES TOKENIZER_JSON TEXTS_JSON bench REPS
//     prints {"seconds": best time of one pass over all texts, "tokens": N}
//
// Run with TOKENIZERS_PARALLELISM=false so that encodeBatch stays on one
// thread.
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const [modules, tokPath, textsPath, mode, repsArg] = process.argv.slice(2);
  const { Tokenizer } = require(path.join(modules, '@anush008', 'tokenizers'));
  const tok = Tokenizer.fromFile(tokPath);
  const texts = JSON.parse(fs.readFileSync(textsPath, 'utf8'));
  const ids = (encs) => encs.map((e) => Array.from(e.getIds()));
  if (mode === 'encode') {
    const plain = ids(await tok.encodeBatch(texts, { addSpecialTokens: false }));
    const special = ids(await tok.encodeBatch(texts, { addSpecialTokens: true }));
    const decoded = await tok.decodeBatch(plain, false);
    process.stdout.write(JSON.stringify({ plain, special, decoded }));
    return;
  }
  if (mode === 'bench') {
    const reps = Number(repsArg || 3);
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

main().catch((err) => {
  process.stderr.write(String(err && err.stack || err) + '\n');
  process.exit(1);
});
