// Regenerates qwen2_golden.jsonl from Hugging Face tokenizers (Rust, through
// the @anush008/tokenizers binding), not from our code. The texts are the
// file's own (hand-picked and random strings, kept as inputs); for each,
// "ids" are the Qwen2 tokenizer's (add_special_tokens false) and "splits"
// the pieces three pre-tokenizers cut it into: "qwen2" and "llama3" the
// pre-tokenizers of the Qwen2 and Llama 3.1 tokenizer.json files (a regex
// Split, then ByteLevel),
// "gpt2" HF's ByteLevel pre-tokenizer with its built-in GPT-2 regex. Pieces
// are the original text's substrings (the offsets HF reports), not the
// byte-level spellings. From the repository root:
//
//   node api/tokenize/testdata/gen_qwen2_golden.js .ci/reference/node_modules \
//     ../shared/tokenizers/qwen2 api/tokenize/testdata/qwen2_golden.jsonl
//
// (after ./.ci/install-reference). TestQwen2GoldenRegenerates runs it and
// requires the committed file back byte for byte.
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const [modules, qwen2Dir, golden, out] = process.argv.slice(2);
  if (!golden) throw new Error('usage: node gen_qwen2_golden.js NODE_MODULES QWEN2_DIR GOLDEN [OUT]');
  const hf = loadHF(modules);
  const qwen2File = path.join(qwen2Dir, 'tokenizer.json');
  const llama3File = path.join(modules, '@lenml', 'tokenizer-llama3_1', 'models', 'tokenizer.json');
  const qwen2 = hf.Tokenizer.fromFile(qwen2File);
  const splitters = {
    qwen2: splitOf(hf, qwen2File),
    llama3: splitOf(hf, llama3File),
    gpt2: hf.byteLevelPreTokenizer(false, true),
  };
  const texts = fs.readFileSync(golden, 'utf8').split('\n').filter((l) => l !== '').map((l) => JSON.parse(l).text);
  const encs = await qwen2.encodeBatch(texts, { addSpecialTokens: false });
  const lines = texts.map((text, i) => {
    const splits = {};
    for (const [name, pt] of Object.entries(splitters)) splits[name] = pieces(pt, text);
    return JSON.stringify({ text, ids: Array.from(encs[i].getIds()), splits });
  });
  fs.writeFileSync(out || golden, lines.join('\n') + '\n');
}

// splitOf is the pre-tokenizer of a tokenizer.json, checked to be a Split
// on a regex followed by ByteLevel without its own regex (which only
// respells bytes: its pieces are the Split's).
function splitOf(hf, file) {
  const seq = JSON.parse(fs.readFileSync(file, 'utf8')).pre_tokenizer;
  const kinds = seq && seq.type === 'Sequence' ? seq.pretokenizers.map((p) => p.type + (p.use_regex ? '+regex' : '')) : [];
  if (kinds.join(',') !== 'Split,ByteLevel' || !seq.pretokenizers[0].pattern.Regex) {
    throw new Error(file + ': pre-tokenizer is ' + JSON.stringify(kinds) + ', want a regex Split then ByteLevel');
  }
  return hf.Tokenizer.fromFile(file).getPreTokenizer();
}

function loadHF(modules) {
  return require(path.resolve(modules, '@anush008', 'tokenizers'));
}

// pieces cuts text at the offsets (in characters) that the pre-tokenizer
// reports, and checks they tile it.
function pieces(pt, text) {
  const chars = Array.from(text);
  const out = pt.preTokenizeString(text).map(([, [a, b]]) => chars.slice(a, b).join(''));
  if (out.join('') !== text) throw new Error('pieces do not tile ' + JSON.stringify(text));
  return out;
}

main().catch((err) => {
  process.stderr.write(String((err && err.stack) || err) + '\n');
  process.exit(1);
});
