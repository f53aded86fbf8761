package tokenize

import (
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/internal/reftest"
)

// qwen2Path is the shared Qwen2 tokenizer.json (reftest.Qwen2Dir:
// $KVROUTER_QWEN2_DIR, else ../shared/tokenizers/qwen2 from the repository),
// skipping the test when it is missing, failing it under
// KVROUTER_REQUIRE_REFERENCE=1.
func qwen2Path(tb testing.TB) string {
	tb.Helper()
	return filepath.Join(reftest.Qwen2Dir(tb), "tokenizer.json")
}

var qwen2 = sync.OnceValues(func() (*HF, error) {
	dir, err := reftest.FindQwen2Dir()
	if err != nil {
		return nil, err
	}
	return LoadHF(filepath.Join(dir, "tokenizer.json"))
})

// loadQwen2 returns the shared Qwen2 tokenizer (loaded once: 7 MB of JSON),
// skipping the test when it is not there (failing under
// KVROUTER_REQUIRE_REFERENCE=1).
func loadQwen2(tb testing.TB) *HF {
	tb.Helper()
	qwen2Path(tb)
	h, err := qwen2()
	if err != nil {
		tb.Fatalf("LoadHF: %v", err)
	}
	return h
}
