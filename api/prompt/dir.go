package prompt

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

// The files of a Hugging Face model directory that decide prompt ids. The
// fingerprint covers all of them, so replicas (and engines) with different
// copies show different fingerprints.
var modelFiles = []string{
	"tokenizer.json",
	"tokenizer_config.json",
	"chat_template.jinja",
	"chat_template.json",
	"generation_config.json",
	"config.json",
}

// tokenizerConfig is the part of tokenizer_config.json that decides ids.
type tokenizerConfig struct {
	ChatTemplate   json.RawMessage `json:"chat_template"`
	TokenizerClass string          `json:"tokenizer_class"`
	AddBOS         *bool           `json:"add_bos_token"`
	AddEOS         *bool           `json:"add_eos_token"`
	ModelMaxLength *float64        `json:"model_max_length"`
	// Special tokens are strings or AddedToken objects ({"content": …}).
	BOS  json.RawMessage `json:"bos_token"`
	EOS  json.RawMessage `json:"eos_token"`
	UNK  json.RawMessage `json:"unk_token"`
	PAD  json.RawMessage `json:"pad_token"`
	SEP  json.RawMessage `json:"sep_token"`
	CLS  json.RawMessage `json:"cls_token"`
	MASK json.RawMessage `json:"mask_token"`
	// AdditionalSpecial is passed to templates as
	// additional_special_tokens, as transformers' special_tokens_map does.
	AdditionalSpecial []json.RawMessage `json:"additional_special_tokens"`
}

// Load reads a Hugging Face model directory: tokenizer.json (required),
// tokenizer_config.json (special tokens, add_bos_token/add_eos_token, chat
// template), optional chat_template.jinja / chat_template.json,
// generation_config.json and config.json. Anything it cannot honour
// exactly fails here, naming the file and the feature.
func Load(name, dir string) (*Model, error) {
	files, err := readModelFiles(dir)
	if err != nil {
		return nil, err
	}
	if files["tokenizer.json"] == nil {
		return nil, fmt.Errorf("model %s: %s: no tokenizer.json", name, dir)
	}
	tok, err := tokenize.LoadHF(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("model %s: %s: %w", name, filepath.Join(dir, "tokenizer.json"), err)
	}
	var cfg tokenizerConfig
	if raw := files["tokenizer_config.json"]; raw != nil {
		if err := json.Unmarshal(raw, &cfg); err != nil {
			return nil, fmt.Errorf("model %s: %s: %w", name, filepath.Join(dir, "tokenizer_config.json"), err)
		}
	}
	for _, f := range []string{"generation_config.json", "config.json", "chat_template.json"} {
		if raw := files[f]; raw != nil && !json.Valid(raw) {
			return nil, fmt.Errorf("model %s: %s: not valid JSON", name, filepath.Join(dir, f))
		}
	}
	m := &Model{name: name, tok: tok, source: dir, fingerprint: fingerprint(files)}
	special, err := cfg.specialTokens()
	if err != nil {
		return nil, fmt.Errorf("model %s: %s: %w", name, filepath.Join(dir, "tokenizer_config.json"), err)
	}
	if m.encodeSpecial, err = specialEncoder(tok, cfg, special); err != nil {
		return nil, fmt.Errorf("model %s: %s: %w", name, filepath.Join(dir, "tokenizer_config.json"), err)
	}
	src, file, err := chatTemplateSource(files, cfg)
	if err != nil {
		return nil, fmt.Errorf("model %s: %s: %w", name, filepath.Join(dir, file), err)
	}
	if src != "" {
		if m.chat, err = parseChat(name, src, special); err != nil {
			return nil, fmt.Errorf("model %s: %s: chat template: %w", name, filepath.Join(dir, file), err)
		}
	}
	m.maxModelLen = maxModelLen(files["config.json"], cfg)
	return m, nil
}

func readModelFiles(dir string) (map[string][]byte, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("model directory: %w", err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("model directory %s: not a directory", dir)
	}
	files := map[string][]byte{}
	for _, f := range modelFiles {
		data, err := os.ReadFile(filepath.Join(dir, f))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("model directory: %w", err)
		}
		files[f] = data
	}
	return files, nil
}

// fingerprint hashes the files present, in a fixed order, with their names.
func fingerprint(files map[string][]byte) string {
	h := sha256.New()
	for _, f := range modelFiles {
		if data, ok := files[f]; ok {
			fmt.Fprintf(h, "%s\x00%d\x00", f, len(data))
			h.Write(data)
		}
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// chatTemplateSource picks the default chat template as transformers and
// vLLM do: chat_template.jinja, else tokenizer_config.json's chat_template
// (a string, or a list of {name, template} of which "default" is used),
// else chat_template.json (a processor's). It returns the file it came from.
func chatTemplateSource(files map[string][]byte, cfg tokenizerConfig) (string, string, error) {
	if data, ok := files["chat_template.jinja"]; ok {
		return string(data), "chat_template.jinja", nil
	}
	if src, err := templateValue(cfg.ChatTemplate); err != nil || src != "" {
		return src, "tokenizer_config.json", err
	}
	if data, ok := files["chat_template.json"]; ok {
		var ct struct {
			ChatTemplate json.RawMessage `json:"chat_template"`
		}
		if err := json.Unmarshal(data, &ct); err != nil {
			return "", "chat_template.json", err
		}
		src, err := templateValue(ct.ChatTemplate)
		return src, "chat_template.json", err
	}
	return "", "", nil
}

func templateValue(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var named []namedTemplate
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", fmt.Errorf("chat_template: want a string or a list of {name, template}: %w", err)
	}
	for _, t := range named {
		if t.Name == "default" {
			return t.Template, nil
		}
	}
	have := make([]string, 0, len(named))
	for _, t := range named {
		have = append(have, t.Name)
	}
	return "", fmt.Errorf("chat_template: a list without a \"default\" template (names: %v)", have)
}

// namedTemplate is one entry of a chat_template list.
type namedTemplate struct {
	Name     string `json:"name"`
	Template string `json:"template"`
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || string(raw) == "null"
}

// tokenString reads a special token: a string or an AddedToken object.
func tokenString(raw json.RawMessage) (string, bool, error) {
	if isNull(raw) {
		return "", false, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, true, nil
	}
	var at struct {
		Content *string `json:"content"`
	}
	if err := json.Unmarshal(raw, &at); err != nil || at.Content == nil {
		return "", false, fmt.Errorf("special token %s: want a string or {\"content\": …}", raw)
	}
	return *at.Content, true, nil
}

// specialTokens is transformers' special_tokens_map: the variables every
// chat template sees.
func (c tokenizerConfig) specialTokens() (map[string]any, error) {
	out := map[string]any{}
	for _, f := range []struct {
		key string
		raw json.RawMessage
	}{{"bos_token", c.BOS}, {"eos_token", c.EOS}, {"unk_token", c.UNK}, {"pad_token", c.PAD},
		{"sep_token", c.SEP}, {"cls_token", c.CLS}, {"mask_token", c.MASK}} {
		s, ok, err := tokenString(f.raw)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.key, err)
		}
		if ok {
			out[f.key] = s
		}
	}
	if len(c.AdditionalSpecial) > 0 {
		extra := make([]any, 0, len(c.AdditionalSpecial))
		for _, raw := range c.AdditionalSpecial {
			s, ok, err := tokenString(raw)
			if err != nil {
				return nil, fmt.Errorf("additional_special_tokens: %w", err)
			}
			if ok {
				extra = append(extra, s)
			}
		}
		out["additional_special_tokens"] = extra
	}
	return out, nil
}

// Tokenizer classes whose fast implementation rebuilds the post-processor
// from add_bos_token / add_eos_token when loaded (transformers'
// LlamaTokenizerFast and GemmaTokenizerFast update_post_processor, with
// add_bos_token defaulting to true), so the config, not tokenizer.json's
// post-processor, decides what add_special_tokens=true adds. DeepSeek V3
// ships a ByteLevel post-processor with add_bos_token true and
// LlamaTokenizerFast: the engine adds BOS. Recent transformers do the same
// for any fast tokenizer whose config sets either flag explicitly.
var bosFromConfig = []string{
	"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
	"GemmaTokenizer", "GemmaTokenizerFast",
}

func specialEncoder(tok *tokenize.HF, cfg tokenizerConfig, special map[string]any) (func(string) []uint32, error) {
	if !slices.Contains(bosFromConfig, cfg.TokenizerClass) && cfg.AddBOS == nil && cfg.AddEOS == nil {
		return tok.EncodeSpecial, nil
	}
	addBOS, addEOS := slices.Contains(bosFromConfig, cfg.TokenizerClass), false // the classes' defaults
	if cfg.AddBOS != nil {
		addBOS = *cfg.AddBOS
	}
	if cfg.AddEOS != nil {
		addEOS = *cfg.AddEOS
	}
	var bos, eos []uint32
	for _, t := range []struct {
		on  bool
		key string
		dst *[]uint32
	}{{addBOS, "bos_token", &bos}, {addEOS, "eos_token", &eos}} {
		if !t.on {
			continue
		}
		s, _ := special[t.key].(string)
		if s == "" {
			return nil, fmt.Errorf("add_%s is true but %s is not set", t.key, t.key)
		}
		id, ok := tok.TokenID(s)
		if !ok {
			return nil, fmt.Errorf("%s %q is not in the vocabulary", t.key, s)
		}
		*t.dst = []uint32{id}
	}
	return func(text string) []uint32 {
		ids := tok.Encode(text)
		out := make([]uint32, 0, len(bos)+len(ids)+len(eos))
		out = append(append(append(out, bos...), ids...), eos...)
		return out
	}, nil
}

// maxModelLen reads the context length as vLLM derives it when nothing
// overrides it: config.json's max_position_embeddings, else the tokenizer's
// model_max_length when it is a real number (transformers writes 1e30 for
// "no limit").
func maxModelLen(configJSON []byte, cfg tokenizerConfig) int {
	var mc struct {
		MaxPos *int `json:"max_position_embeddings"`
	}
	if configJSON != nil && json.Unmarshal(configJSON, &mc) == nil && mc.MaxPos != nil && *mc.MaxPos > 0 {
		return *mc.MaxPos
	}
	if cfg.ModelMaxLength != nil && *cfg.ModelMaxLength > 0 && *cfg.ModelMaxLength < 1<<40 {
		return int(*cfg.ModelMaxLength)
	}
	return 0
}
