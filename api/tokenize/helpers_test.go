package tokenize

import (
	"os"
	"sync"
	"testing"
)

// qwen2Path is the shared Qwen2 tokenizer; KVROUTER_QWEN2_TOKENIZER
// overrides it (file or directory).
func qwen2Path() string {
	if p := os.Getenv("KVROUTER_QWEN2_TOKENIZER"); p != "" {
		return p
	}
	return "/work/shared/tokenizers/qwen2/tokenizer.json"
}

var qwen2 = sync.OnceValues(func() (*HF, error) { return LoadHF(qwen2Path()) })

// loadQwen2 returns the shared Qwen2 tokenizer (loaded once: 7 MB of JSON),
// skipping the test when the file is not on this machine.
func loadQwen2(tb testing.TB) *HF {
	tb.Helper()
	if _, err := os.Stat(qwen2Path()); err != nil {
		tb.Skipf("qwen2 tokenizer not available: %v", err)
	}
	h, err := qwen2()
	if err != nil {
		tb.Fatalf("LoadHF: %v", err)
	}
	return h
}
