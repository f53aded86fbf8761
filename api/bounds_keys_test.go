package api

import "testing"

// Only keys that name a credential are redacted in the status document.
func TestAPISecretKeys(t *testing.T) {
	for key, secret := range map[string]bool{
		"admin_token": true, "replica_token": true, "token": true, "password": true, "api_key": true, "apikey": true,
		"nats_seed": true, "credentials": true,
		"tokenizer_check": false, "tokenizers": false, "max_tokens": false, "prompt_tokens": false, "tokenizer": false,
		"seed_prefix_blocks": true, // conservative: a leading "seed" word is treated as a credential
	} {
		if got := secretKeyRE.MatchString(key); got != secret {
			t.Errorf("%q: redacted=%v, want %v", key, got, secret)
		}
	}
}
