package pki

import (
	"os"
	"slices"
	"testing"
)

func TestPKILayoutEnsure(t *testing.T) {
	l := Layout{Dir: t.TempDir()}
	holders := []Holder{
		{Identity: Node("n1"), Hosts: []string{"127.0.0.1", "n1"}},
		{Identity: Node("n2"), Hosts: []string{"127.0.0.1", "n2"}},
		{Identity: Worker("w1")},
	}
	issued, err := l.Ensure(holders)
	if err != nil || len(issued) != 3 {
		t.Fatalf("first run: %v, %v", issued, err)
	}
	caBefore, _ := os.ReadFile(l.CACertFile())
	// Idempotent: nothing reissued, the CA kept.
	if issued, err = l.Ensure(holders); err != nil || len(issued) != 0 {
		t.Fatalf("second run: %v, %v", issued, err)
	}
	// A new host for n2 and a new node: only those two are issued, by the
	// same CA.
	holders[1].Hosts = append(holders[1].Hosts, "10.0.0.2")
	holders = append(holders, Holder{Identity: Node("n3")})
	if issued, err = l.Ensure(holders); err != nil || !slices.Equal(issued, []Identity{Node("n2"), Node("n3")}) {
		t.Fatalf("third run: %v, %v", issued, err)
	}
	caAfter, _ := os.ReadFile(l.CACertFile())
	if string(caBefore) != string(caAfter) {
		t.Fatal("CA replaced")
	}
	for _, h := range holders {
		b, err := LoadBundle(l.Material(h.Identity))
		if err != nil || b.Identity() != h.Identity {
			t.Fatalf("%v: %v", h.Identity, err)
		}
	}
	if _, err := l.Ensure([]Holder{{Identity: Worker("../etc/passwd")}}); err == nil {
		t.Fatal("id that is a path accepted")
	}
}
