package reftest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Without ../shared beside the checkout, the Qwen2 tokenizer comes from
// the npm Qwen1.5 package only when its tokenizer.json is the shared one,
// byte for byte.
func TestFindQwen2DirNPMFallback(t *testing.T) {
	real, realErr := FindQwen2Dir() // before leaving the repository
	mod := t.TempDir()
	if err := os.WriteFile(filepath.Join(mod, "go.mod"), []byte("module x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	npm := filepath.Join(mod, "nm")
	models := filepath.Join(npm, "@lenml", "tokenizer-qwen1_5", "models")
	if err := os.MkdirAll(models, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(mod)
	t.Setenv("KVROUTER_QWEN2_DIR", "")
	t.Setenv("KVROUTER_REF_NPM", npm)
	if _, err := FindQwen2Dir(); err == nil {
		t.Fatal("found a Qwen2 tokenizer in an empty fallback")
	}
	if err := os.WriteFile(filepath.Join(models, "tokenizer.json"), []byte(`{"not":"qwen2"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := FindQwen2Dir(); err == nil || !strings.Contains(err.Error(), "sha256") {
		t.Fatalf("another tokenizer.json accepted: %v", err)
	}
	if realErr != nil {
		Missing(t, "the real Qwen2 tokenizer, to check the fallback accepts it: %v", realErr)
	}
	data, err := os.ReadFile(filepath.Join(real, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(models, "tokenizer.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	if dir, err := FindQwen2Dir(); err != nil || dir != models {
		t.Fatalf("the shared tokenizer's bytes under the npm path: %q, %v", dir, err)
	}
}
