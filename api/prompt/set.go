package prompt

import (
	"sort"
	"sync"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

// Set answers which Model tokenizes requests for a served model name:
//
//   - a model with its own directory (--model-dir NAME=DIR) uses its files;
//   - a model named in --model without a directory uses the replica-wide
//     --tokenizer / --chat-template (the form that predates model
//     directories);
//   - any other model (registered by workers only) uses that same default
//     when no model has a directory, as before; once directories are in use
//     it has no tokenizer at all: its requests are routed by load only, and
//     the caller must say so loudly (Lookup's second result).
type Set struct {
	dirs     map[string]*Model
	listed   map[string]bool
	tok      tokenize.Tokenizer
	tmpl     tokenize.Template
	source   string
	mu       sync.Mutex
	fallback map[string]*Model // legacy models by name, built on first use; mu guards it
}

// NewSet builds the set. listed are the --model names; dirs the loaded
// model directories; tok/tmpl/source the replica-wide default.
func NewSet(listed []string, dirs []*Model, tok tokenize.Tokenizer, tmpl tokenize.Template, source string) *Set {
	s := &Set{dirs: map[string]*Model{}, listed: map[string]bool{}, tok: tok, tmpl: tmpl, source: source,
		fallback: map[string]*Model{}}
	for _, m := range dirs {
		s.dirs[m.Name()] = m
	}
	for _, n := range listed {
		s.listed[n] = true
	}
	return s
}

// Lookup returns the model's tokenizing Model; false when it has none.
func (s *Set) Lookup(model string) (*Model, bool) {
	if m, ok := s.dirs[model]; ok {
		return m, true
	}
	if !s.listed[model] && len(s.dirs) > 0 {
		return nil, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.fallback[model]
	if !ok {
		m = Legacy(model, s.tok, s.tmpl, s.source)
		s.fallback[model] = m
	}
	return m, true
}

// Describe is each model's tokenizer as /cluster/status shows it: source
// and fingerprint, or "none" for a model without files.
func (s *Set) Describe(models []string) []map[string]any {
	sort.Strings(models)
	out := make([]map[string]any, 0, len(models))
	for _, name := range models {
		m, ok := s.Lookup(name)
		if !ok {
			out = append(out, map[string]any{"model": name, "tokenizer": "none",
				"warning": "no model files on this replica: requests are routed by load only (no prefix hits); start with --model-dir " + name + "=DIR"})
			continue
		}
		out = append(out, map[string]any{"model": name, "tokenizer": m.Tokenizer().Name(), "source": m.Source(),
			"fingerprint": m.Fingerprint(), "chat_template": m.HasChatTemplate()})
	}
	return out
}
