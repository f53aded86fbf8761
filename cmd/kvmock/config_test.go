package main

import (
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/tokenize"
)

func TestMockConfigDefaults(t *testing.T) {
	c, err := parseConfig(nil, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.ID != "mock-1" || c.Addr != "127.0.0.1:9001" || c.Model != "kvmock" || c.BlockSize != 16 || c.KVBlocks != 4096 ||
		c.MaxBatchedTokens != 8192 || c.MaxRunning != 256 || c.Speedup != 1 || c.NATS != "" || c.Register != nil ||
		c.RegisterInterval != 30*time.Second || c.ChatTemplate != tokenize.Plain || c.LogLevel != slog.LevelInfo || c.AdvertiseURL != "" || c.EventIDStart != 0 ||
		c.HostTierBlocks != 0 {
		t.Fatalf("defaults: %+v", c)
	}
}

func TestMockConfigFlagsAndEnv(t *testing.T) {
	env := map[string]string{
		"KVMOCK_ID":               "env-id",
		"KVMOCK_KV_BLOCKS":        "100",
		"KVMOCK_NATS":             " nats://a:4222, nats://b:4223 ,",
		"KVMOCK_REGISTER":         "http://r1:8001/, http://r2:8002",
		"KVMOCK_SPEEDUP":          "2.5",
		"KVMOCK_LOG_LEVEL":        "debug",
		"KVMOCK_ADVERTISE_URL":    "http://mock:9001/",
		"KVMOCK_PROFILE":          "seed001-small",
		"KVMOCK_HOST_TIER_BLOCKS": "300",
	}
	c, err := parseConfig([]string{"--id", "flag-id", "--block-size=32"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.ID != "flag-id" { // the flag wins over the environment
		t.Fatalf("id %q", c.ID)
	}
	if c.KVBlocks != 100 || c.BlockSize != 32 || c.Speedup != 2.5 || c.LogLevel != slog.LevelDebug || c.Profile != "seed001-small" ||
		c.HostTierBlocks != 300 {
		t.Fatalf("config %+v", c)
	}
	if c.NATS != "nats://a:4222,nats://b:4223" || !slices.Equal(c.Register, []string{"http://r1:8001", "http://r2:8002"}) || c.AdvertiseURL != "http://mock:9001" {
		t.Fatalf("lists: %q %q %q", c.NATS, c.Register, c.AdvertiseURL)
	}
}

func TestMockConfigInvalid(t *testing.T) {
	none := func(string) string { return "" }
	for _, args := range [][]string{
		{"--id", ""}, {"--id", "a#1"}, {"--block-size", "0"}, {"--kv-blocks", "-1"}, {"--speedup", "0"},
		{"--profile", "nope"}, {"--chat-template", "jinja"}, {"--log-level", "loud"}, {"--register", "r1:8001"},
		{"--max-running", "0"}, {"stray"}, {"--unknown"}, {"--host-tier-blocks", "-1"}, {"--scheduling-policy", "sjf"},
		{"--events-per-msg", "0"}, {"--events-per-msg", "4097"},
	} {
		if _, err := parseConfig(args, none, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	if _, err := parseConfig(nil, func(k string) string {
		if k == "KVMOCK_KV_BLOCKS" {
			return "many"
		}
		return ""
	}, io.Discard); err == nil || !strings.Contains(err.Error(), "KVMOCK_KV_BLOCKS") {
		t.Errorf("bad env value: %v", err)
	}
	if _, err := parseConfig([]string{"-h"}, none, io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v", err)
	}
	// A model length beyond the cache is the engine's to refuse.
	c, err := parseConfig([]string{"--kv-blocks", "4", "--max-model-len", "1000"}, none, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := newMock(c, testLog(t), nil); err == nil {
		t.Error("max model len beyond the cache accepted")
	}
}

func TestMockAdvertiseURL(t *testing.T) {
	for _, c := range []struct{ conf, addr, want string }{
		{"", "127.0.0.1:9001", "http://127.0.0.1:9001"},
		{"", "0.0.0.0:9001", "http://127.0.0.1:9001"},
		{"", "[::]:9001", "http://127.0.0.1:9001"},
		{"", "10.1.2.3:9001", "http://10.1.2.3:9001"},
		{"http://mock-3:80", "0.0.0.0:9001", "http://mock-3:80"},
	} {
		addr, err := net.ResolveTCPAddr("tcp", c.addr)
		if err != nil {
			t.Fatal(err)
		}
		if got := advertiseURL(c.conf, addr); got != c.want {
			t.Errorf("advertiseURL(%q, %s) = %q, want %q", c.conf, c.addr, got, c.want)
		}
	}
}

func TestMockOutputText(t *testing.T) {
	tok := tokenize.Builtin()
	ids := outputIDs(7, []uint32{1, 2, 3}, 50)
	if !slices.Equal(ids, outputIDs(7, []uint32{1, 2, 3}, 50)) || slices.Equal(ids, outputIDs(8, []uint32{1, 2, 3}, 50)) {
		t.Fatal("output ids not deterministic per seed and prompt")
	}
	pieces := outputPieces(tok, ids)
	text := strings.Join(pieces, "")
	if text != tok.Decode(ids) {
		t.Fatalf("pieces %q != Decode %q", text, tok.Decode(ids))
	}
	if back := tok.Encode(text); !slices.Equal(back, ids) {
		t.Fatalf("re-encoding the answer gives other ids")
	}
}
