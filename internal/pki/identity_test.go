package pki

import (
	"crypto/x509"
	"errors"
	"net/url"
	"testing"
)

func TestPKIIdentityRoundTrip(t *testing.T) {
	for _, id := range []Identity{Node("n1"), Worker("w-1"), Worker("host:8000/dp 0"), Worker("ünï%2F"), Node("a.b_c")} {
		back, err := ParseIdentity(id.String())
		if err != nil {
			t.Fatalf("%q: %v", id.ID, err)
		}
		if back != id {
			t.Fatalf("round trip %#v → %s → %#v", id, id, back)
		}
	}
	if got := Node("n1").String(); got != "spiffe://kvrouter/node/n1" {
		t.Fatalf("Node(n1) = %s", got)
	}
	if got := Worker("w1").String(); got != "spiffe://kvrouter/worker/w1" {
		t.Fatalf("Worker(w1) = %s", got)
	}
}

func TestPKIIdentityRefused(t *testing.T) {
	for _, s := range []string{
		"spiffe://other/node/n1", "https://kvrouter/node/n1", "spiffe://kvrouter/admin/n1",
		"spiffe://kvrouter/node", "spiffe://kvrouter/node/", "spiffe://kvrouter/node/a/b",
		"spiffe://user@kvrouter/node/n1", "spiffe://kvrouter/node/n1?x=1", "spiffe://kvrouter/node/%00",
	} {
		if id, err := ParseIdentity(s); err == nil {
			t.Errorf("%s parsed as %#v", s, id)
		}
	}
}

func TestPKIIdentityOfCertificate(t *testing.T) {
	uri := func(s string) *url.URL { u, _ := url.Parse(s); return u }
	tests := []struct {
		name string
		uris []*url.URL
		want Identity
		err  bool
	}{
		{"one", []*url.URL{uri("spiffe://kvrouter/node/n1")}, Node("n1"), false},
		{"foreign domain ignored", []*url.URL{uri("spiffe://other/node/x"), uri("spiffe://kvrouter/worker/w")}, Worker("w"), false},
		{"none", nil, Identity{}, true},
		{"two is none", []*url.URL{uri("spiffe://kvrouter/node/n1"), uri("spiffe://kvrouter/node/n2")}, Identity{}, true},
		{"malformed ours", []*url.URL{uri("spiffe://kvrouter/root/n1")}, Identity{}, true},
	}
	for _, tt := range tests {
		got, err := IdentityOf(&x509.Certificate{URIs: tt.uris})
		if (err != nil) != tt.err || got != tt.want {
			t.Errorf("%s: got %#v, %v", tt.name, got, err)
		}
		if tt.name == "none" && !errors.Is(err, ErrNoIdentity) {
			t.Errorf("none: %v is not ErrNoIdentity", err)
		}
	}
}
