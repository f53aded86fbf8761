package main

import (
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// --worker-api-keys-file: each worker id to the key in the file it names
// (relative to the map file, or absolute); malformed maps are refused with
// the line; keys never print.
func TestWorkerKeysFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("keys/a.key", "key-of-a\n")
	abs := write("elsewhere/b.key", "key-of-b")
	write("keys/empty.key", "\n")
	cases := []struct {
		name, text string
		want       map[string]string
		err        string
	}{
		{"relative and absolute", "# id  key file\nvllm-a keys/a.key\n\nvllm-b\t" + abs + "\n", map[string]string{"vllm-a": "key-of-a", "vllm-b": "key-of-b"}, ""},
		{"one field", "vllm-a\n", nil, "line 1: want"},
		{"three fields", "vllm-a keys/a.key extra\n", nil, "line 1: want"},
		{"a rank", "vllm-a#1 keys/a.key\n", nil, "names a rank"},
		{"twice", "vllm-a keys/a.key\nvllm-a keys/a.key\n", nil, "line 2: worker \"vllm-a\" named twice"},
		{"missing key file", "vllm-a keys/none.key\n", nil, "line 1 (worker \"vllm-a\")"},
		{"empty key file", "vllm-a keys/empty.key\n", nil, "is empty"},
		{"no worker", "# nothing\n", nil, "names no worker"},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// Key files are relative to the map's directory, not the cwd.
			path := write("map-"+strconv.Itoa(i), c.text)
			got, err := parseServe([]string{"--single-node", "--worker-api-keys-file", path}, func(string) string { return "" }, io.Discard)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("error %v, want one containing %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got.WorkerAPIKeys) != len(c.want) {
				t.Fatalf("keys for %d workers, want %d", len(got.WorkerAPIKeys), len(c.want))
			}
			for id, k := range c.want {
				if got.WorkerAPIKeys[id].Reveal() != k {
					t.Fatalf("worker %s: wrong key", id)
				}
				if s := got.WorkerAPIKeys[id].String(); strings.Contains(s, k) {
					t.Fatalf("key prints as %q", s)
				}
			}
		})
	}
}
