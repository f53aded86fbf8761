// Package prompt turns OpenAI request bodies into the token ids an inference
// engine computes for them, per served model: the model's own tokenizer,
// chat template and special-token rules, with vLLM's request defaults. The
// router hashes exactly these ids into KV block hashes, so anything that
// differs from the engine by one id turns every later block into a miss.
package prompt

import (
	"bytes"
	"encoding/json"
	"fmt"
	"unicode/utf8"
	"unsafe"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

// Model knows how one served model turns requests into token ids. It is
// safe for concurrent use.
type Model struct {
	name string
	tok  tokenize.Tokenizer
	chat chatRenderer
	// encodeSpecial encodes with add_special_tokens=true: what the
	// tokenizer adds around a single sequence (BOS for Llama and Gemma,
	// nothing for Qwen).
	encodeSpecial func(text string) []uint32
	// prefixes reuses the ids of recent prompts' leading bytes, for a
	// tokenizer that vouches for where a text may be cut (nil: none does).
	prefixes *tokenize.PrefixCache
	// fingerprint identifies the files the ids come from: two replicas
	// with equal fingerprints tokenize alike.
	fingerprint string
	source      string // model directory, or "--tokenizer …" for the legacy form
	maxModelLen int
}

// chatRenderer renders a chat completions body to the prompt string.
type chatRenderer interface {
	render(body []byte) (string, error)
}

// Name is the served model name.
func (m *Model) Name() string { return m.name }

// Tokenizer is the model's tokenizer.
func (m *Model) Tokenizer() tokenize.Tokenizer { return m.tok }

// Fingerprint is a short hash of the model's tokenizer and template files.
func (m *Model) Fingerprint() string { return m.fingerprint }

// Source says where the model's tokenizer came from (for status pages).
func (m *Model) Source() string { return m.source }

// MaxModelLen is the model's context length as its files state it (0:
// unknown).
func (m *Model) MaxModelLen() int { return m.maxModelLen }

// HasChatTemplate says whether chat requests can be rendered.
func (m *Model) HasChatTemplate() bool { return m.chat != nil }

// RequestError is a request the model cannot turn into tokens: the API
// answers it with 400 and this message (a template's raise_exception
// message verbatim, as vLLM does).
type RequestError struct{ Msg string }

func (e *RequestError) Error() string { return e.Msg }

func badRequest(format string, args ...any) error {
	return &RequestError{Msg: fmt.Sprintf(format, args...)}
}

// specialFlag is the request's add_special_tokens, absent = nil.
type specialFlag struct {
	AddSpecialTokens *bool `json:"add_special_tokens"`
}

// Fields are the top-level values of a request body that tokenizing reads,
// taken out by the caller in its own single pass over a body it checked is
// valid JSON (api/jsonscan vouches that encoding/json would read the same):
// raw JSON values, nil when absent. Without Known the body is read here.
type Fields struct {
	Known                    bool
	Prompt, AddSpecialTokens json.RawMessage
}

// special is addSpecial from the raw value: ok false when the value is not
// a boolean or null, whose error encoding/json words (addSpecial).
func (f Fields) special(def bool) (v, ok bool) {
	switch string(f.AddSpecialTokens) {
	case "", "null":
		return def, true
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

func addSpecial(body []byte, def bool) (bool, error) {
	var f specialFlag
	if err := json.Unmarshal(body, &f); err != nil {
		return false, badRequest("invalid JSON body: %v", err)
	}
	if f.AddSpecialTokens == nil {
		return def, nil
	}
	return *f.AddSpecialTokens, nil
}

func (m *Model) encode(text string, special bool) []uint32 {
	if m.prefixes != nil {
		return m.prefixes.Encode(text, special)
	}
	if special {
		return m.encodeSpecial(text)
	}
	return m.tok.Encode(text)
}

// Chat returns the prompt token ids of a chat completions body as vLLM
// computes them: the chat template renders the conversation, then the text
// is encoded with add_special_tokens defaulting to false (the template
// writes its own BOS).
func (m *Model) Chat(body []byte) ([]uint32, error) {
	if m.chat == nil {
		return nil, badRequest("model %q has no chat template: use /v1/completions", m.name)
	}
	special, err := addSpecial(body, false)
	if err != nil {
		return nil, err
	}
	text, err := m.chat.render(body)
	if err != nil {
		return nil, err
	}
	return m.encode(text, special), nil
}

// ChatFields is Chat with the body's add_special_tokens already taken out
// (f), saving a pass over the body.
func (m *Model) ChatFields(body []byte, f Fields) ([]uint32, error) {
	special, ok := f.special(false)
	if !f.Known || !ok || m.chat == nil {
		return m.Chat(body)
	}
	text, err := m.chat.render(body)
	if err != nil {
		return nil, err
	}
	return m.encode(text, special), nil
}

// CompletionFields is Completion with the body's prompt and
// add_special_tokens already taken out (f): the body is not read again.
func (m *Model) CompletionFields(body []byte, f Fields) ([][]uint32, error) {
	special, ok := f.special(true)
	if !f.Known || !ok {
		return m.Completion(body)
	}
	return m.prompts(f.Prompt, special)
}

// Completion returns the token ids of each prompt of a completions body: a
// string, a list of strings, a list of token ids, or a list of those.
// Strings are encoded with add_special_tokens defaulting to true, as vLLM
// does (BOS for Llama 3); token ids pass through unchanged.
func (m *Model) Completion(body []byte) ([][]uint32, error) {
	var in struct {
		Prompt json.RawMessage `json:"prompt"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return nil, badRequest("invalid JSON body: %v", err)
	}
	special, err := addSpecial(body, true)
	if err != nil {
		return nil, err
	}
	return m.prompts(in.Prompt, special)
}

func (m *Model) prompts(raw json.RawMessage, special bool) ([][]uint32, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, badRequest("prompt is required")
	}
	if m.prefixes != nil {
		// The prompt's bytes are read in place: the Splitter keeps
		// nothing of the text it encodes and the cache keeps copies, so
		// the string lives only while it is encoded (and raw is not
		// changed meanwhile: it is the caller's, read here only).
		if in, ok := plainBytes(raw); ok {
			return [][]uint32{m.encode(unsafe.String(unsafe.SliceData(in), len(in)), special)}, nil
		}
	} else if text, ok := plainString(raw); ok {
		return [][]uint32{m.encode(text, special)}, nil
	}
	var text string
	if err := json.Unmarshal(raw, &text); err == nil {
		return [][]uint32{m.encode(text, special)}, nil
	}
	var ids []uint32
	if err := json.Unmarshal(raw, &ids); err == nil {
		if len(ids) == 0 {
			return nil, badRequest("prompt must not be empty")
		}
		return [][]uint32{ids}, nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil || len(items) == 0 {
		return nil, badRequest("prompt must be a string, an array of token ids, or a non-empty array of those")
	}
	out := make([][]uint32, 0, len(items))
	for i, it := range items {
		if err := json.Unmarshal(it, &text); err == nil {
			out = append(out, m.encode(text, special))
			continue
		}
		if err := json.Unmarshal(it, &ids); err == nil && len(ids) > 0 {
			out = append(out, ids)
			continue
		}
		return nil, badRequest("prompt[%d] must be a string or a non-empty array of token ids", i)
	}
	return out, nil
}

// Tokenize answers vLLM's POST /tokenize body: a chat request ("messages")
// or a completion request ("prompt", one string or token list).
func (m *Model) Tokenize(body []byte) ([]uint32, error) {
	var probe struct {
		Messages json.RawMessage `json:"messages"`
		Prompt   json.RawMessage `json:"prompt"`
	}
	if err := json.Unmarshal(body, &probe); err != nil {
		return nil, badRequest("invalid JSON body: %v", err)
	}
	if len(probe.Messages) > 0 {
		return m.Chat(body)
	}
	var in struct {
		Prompt *string `json:"prompt"`
	}
	if err := json.Unmarshal(body, &in); err != nil || in.Prompt == nil {
		return nil, badRequest("tokenize: want \"messages\" or a string \"prompt\"")
	}
	special, err := addSpecial(body, true)
	if err != nil {
		return nil, err
	}
	return m.encode(*in.Prompt, special), nil
}

// legacyChat is the built-in ChatML / plain rendering used with --tokenizer
// (no model directory): role and content only.
type legacyChat struct{ tmpl tokenize.Template }

func (l legacyChat) render(body []byte) (string, error) {
	var in struct {
		Messages []tokenize.Message `json:"messages"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return "", badRequest("invalid JSON body: %v", err)
	}
	if len(in.Messages) == 0 {
		return "", badRequest("messages must not be empty")
	}
	text, err := tokenize.RenderChat(in.Messages, l.tmpl, true)
	if err != nil {
		return "", badRequest("%v", err)
	}
	return text, nil
}

// Legacy is a model tokenized by tok and rendered by one of the built-in
// templates: what `--tokenizer` / `--chat-template` configure.
func Legacy(name string, tok tokenize.Tokenizer, tmpl tokenize.Template, source string) *Model {
	m := &Model{
		name: name, tok: tok, chat: legacyChat{tmpl}, encodeSpecial: tok.EncodeSpecial,
		fingerprint: "legacy:" + tok.Name() + "/" + tmpl.String(), source: source,
	}
	if sp, ok := tok.(tokenize.Splitter); ok {
		// encodeSpecial is the tokenizer's own, which the cache calls.
		m.prefixes = tokenize.NewPrefixCache(sp, tokenize.PrefixCacheChunk, prefixCacheBudget)
	}
	return m
}

// prefixCacheBudget is the bytes of prompt text and ids one model's prefix
// cache holds: ~300 prompts of 2,400 words, a few hundred conversations'
// latest turns.
const prefixCacheBudget = 8 << 20

// plainString is the value of raw, a valid JSON value, when it is a string
// whose bytes are its value: no escapes, valid UTF-8 (encoding/json
// replaces invalid bytes). A long prompt is then not scanned twice more by
// encoding/json; anything else is left to it.
func plainString(raw []byte) (string, bool) {
	in, ok := plainBytes(raw)
	return string(in), ok
}

// plainBytes is plainString's bytes, within raw.
func plainBytes(raw []byte) ([]byte, bool) {
	if len(raw) < 2 || raw[0] != '"' || raw[len(raw)-1] != '"' {
		return nil, false
	}
	in := raw[1 : len(raw)-1]
	if bytes.IndexByte(in, '\\') >= 0 || !utf8.Valid(in) {
		return nil, false
	}
	return in, true
}
