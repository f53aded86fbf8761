package pki

import (
	"crypto/subtle"
	"fmt"
	"log/slog"
	"os"
	"strings"
)

// Secret is a credential (a token, a password) that does not print itself:
// fmt, slog and encoding/json all see "[redacted]", so a config struct
// holding one can be logged or put in a status page whole. Reveal is the
// only way out, and should appear only where the secret is sent.
type Secret string

const redacted = "[redacted]"

// Reveal is the secret itself.
func (s Secret) Reveal() string { return string(s) }

// IsZero reports whether no secret is set.
func (s Secret) IsZero() bool { return s == "" }

// Equal compares in constant time, so response timing does not leak how
// much of a guess was right.
func (s Secret) Equal(guess string) bool {
	return s != "" && subtle.ConstantTimeCompare([]byte(s), []byte(guess)) == 1
}

func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return redacted
}

// GoString covers %#v.
func (s Secret) GoString() string { return fmt.Sprintf("pki.Secret(%q)", s.String()) }

// LogValue covers slog.
func (s Secret) LogValue() slog.Value { return slog.StringValue(s.String()) }

// MarshalText covers encoding/json, encoding/xml and friends.
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// ReadSecretFile reads a secret from a file (the *_FILE convention, so
// secrets never need to be on a command line), without its trailing
// newline. Errors name the file only.
func ReadSecretFile(path string) (Secret, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read secret: %w", err)
	}
	s := strings.TrimRight(string(data), "\r\n")
	if s == "" {
		return "", fmt.Errorf("secret file %s is empty", path)
	}
	return Secret(s), nil
}
