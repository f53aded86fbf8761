package disaggflag

import (
	"flag"
	"io"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// kvrouter serve's defaults, applied through Register as kvbench does.
func TestDisaggFlagDefaults(t *testing.T) {
	var s Settings
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	for _, f := range s.Flags() {
		if err := f.Register(fs); err != nil {
			t.Fatal(err)
		}
	}
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	want := Settings{Mode: router.DisaggOff, KV: router.KVQwen3_0_6B, LinkMBps: 104, Profile: "dynamo-mocker", Speedup: 1, Retries: 1}
	if s != want {
		t.Fatalf("defaults %+v, want %+v", s, want)
	}
	if _, err := s.RouterConfig(); err != nil {
		t.Fatalf("defaults do not make a router config: %v", err)
	}
}

func TestDisaggFlagParse(t *testing.T) {
	var s Settings
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	for _, f := range s.Flags() {
		f.Names = append(f.Names, "x-"+f.Names[0]) // an alias sets the same field
		if err := f.Register(fs); err != nil {
			t.Fatal(err)
		}
	}
	err := fs.Parse([]string{"--disagg", "auto", "--x-disagg-kv-bytes-per-token", "70000", "--disagg-model-shape", "32,8,128,2",
		"--disagg-link-mbps", "1000", "--x-disagg-link-per-pair", "--disagg-link-max-transfers", "4", "--disagg-link-latency", "2ms",
		"--disagg-profile", "seed001-small", "--disagg-speedup", "4", "--disagg-transfer-retries", "0"})
	if err != nil {
		t.Fatal(err)
	}
	want := Settings{Mode: router.DisaggAuto, KV: router.ModelKV{Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, Given: 70000},
		LinkMBps: 1000, LinkPerPair: true, LinkMax: 4, LinkLatency: 2 * time.Millisecond, Profile: "seed001-small", Speedup: 4}
	if s != want {
		t.Fatalf("got %+v, want %+v", s, want)
	}
	dc, err := s.RouterConfig()
	if err != nil {
		t.Fatal(err)
	}
	if dc.KV.BytesPerToken() != 70000 || dc.Topology.Links["link"].ThroughputBytesPerS != 4e9 {
		t.Fatalf("router config %+v", dc)
	}
	for _, bad := range [][]string{
		{"--disagg", "sometimes"}, {"--disagg-kv-bytes-per-token", "-1"}, {"--disagg-model-shape", "28,8"},
		{"--disagg-link-mbps", "fast"}, {"--disagg-link-latency", "2"}, {"--disagg-transfer-retries", "one"},
	} {
		var s Settings
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		for _, f := range s.Flags() {
			if err := f.Register(fs); err != nil {
				t.Fatal(err)
			}
		}
		if err := fs.Parse(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
