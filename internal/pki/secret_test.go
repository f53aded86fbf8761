package pki

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestPKISecretNeverPrints(t *testing.T) {
	s := Secret("hunter2")
	var buf bytes.Buffer
	slog.New(slog.NewTextHandler(&buf, nil)).Info("x", "token", s, "cfg", struct{ T Secret }{s})
	j, _ := json.Marshal(struct{ T Secret }{s})
	out := strings.Join([]string{fmt.Sprint(s), fmt.Sprintf("%v %s %q %+v %#v", s, s, s, struct{ T Secret }{s}, s), buf.String(), string(j)}, "\n")
	if strings.Contains(out, "hunter2") {
		t.Fatalf("secret printed:\n%s", out)
	}
	if !s.Equal("hunter2") || s.Equal("hunter") || Secret("").Equal("") {
		t.Fatal("Equal")
	}
}

func TestPKIReadSecretFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "tok")
	if err := os.WriteFile(p, []byte("abc\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := ReadSecretFile(p)
	if err != nil || s.Reveal() != "abc" {
		t.Fatalf("got %q, %v", s.Reveal(), err)
	}
	if err := os.WriteFile(p, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadSecretFile(p); err == nil {
		t.Fatal("empty secret accepted")
	}
}
