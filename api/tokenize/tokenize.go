// Package tokenize turns prompt text into the token ids an inference worker
// would compute for it, so the router can hash those ids into KV block hashes
// (see router.BlockHashes) and look them up in its prefix index.
//
// Two implementations share one interface:
//
//   - HF: a BPE tokenizer loaded from a Hugging Face tokenizer.json
//     (Qwen, Llama 2/3, DeepSeek V3, Gemma, gpt-oss, GPT-2 style). It must
//     agree with the worker's tokenizer bit for bit: one differing id
//     changes every block hash after it, and the router silently stops
//     finding cache hits.
//   - Builtin: a zero-configuration, file-free tokenizer shared by kvmock and
//     the router for tests and demos.
//
// Chat requests are rendered to a prompt string first (RenderChat), then
// encoded.
package tokenize

// Tokenizer converts between text and token ids. Implementations are safe
// for concurrent use.
type Tokenizer interface {
	// Encode returns the token ids of text as the worker would compute them
	// without adding any BOS/EOS tokens (add_special_tokens=false): chat
	// templates already spell out their special tokens.
	Encode(text string) []uint32
	// EncodeSpecial is Encode with add_special_tokens=true: it adds what
	// the tokenizer's post-processor adds around a single sequence (BOS
	// for Llama 2/3 and Gemma, nothing for Qwen).
	EncodeSpecial(text string) []uint32
	// Decode returns the text of ids. Unknown ids are skipped.
	Decode(ids []uint32) string
	// Name identifies the tokenizer (for logs and metrics labels).
	Name() string
}
