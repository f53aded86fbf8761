package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/replica"
	"github.com/kvrouter/kvrouter/router"
)

func TestServeConfig(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	tests := []struct {
		name  string
		args  []string
		env   map[string]string
		ok    bool
		check func(serveConfig) bool
	}{
		{"defaults single node", []string{"--single-node"}, nil, true, func(c serveConfig) bool {
			return c.Router.Mode == router.ModeKV && c.Router.BlockSize == 16 && c.DataDir == "data/r1" && c.BusyStatus == 529
		}},
		{"dynamo flag spellings", []string{"--single-node", "--router-mode", "kv", "--router-kv-overlap-score-credit", "0.5",
			"--router-prefill-load-scale", "16", "--router-temperature", "0.1", "--no-router-track-prefill-tokens",
			"--active-decode-blocks-threshold", "0.85", "--active-prefill-tokens-threshold", "10000", "--router-queue-threshold", "0.5", "--router-queue-policy", "wspt"}, nil, true,
			func(c serveConfig) bool {
				r := c.Router
				return r.OverlapCredit == 0.5 && r.PrefillLoadScale == 16 && r.Temperature == 0.1 && !r.TrackPrefillTokens &&
					*r.Thresholds.ActiveDecodeBlocks == 0.85 && *r.Thresholds.ActivePrefillTokens == 10000 && r.QueuePolicy == router.QueueWSPT
			}},
		{"pprof on loopback", []string{"--single-node", "--pprof-addr", "127.0.0.1:0"}, nil, true, func(c serveConfig) bool { return c.PprofAddr == "127.0.0.1:0" }},
		{"pprof from the environment", []string{"--single-node"}, map[string]string{"KVROUTER_PPROF_ADDR": "[::1]:6060"}, true,
			func(c serveConfig) bool { return c.PprofAddr == "[::1]:6060" }},
		{"pprof off by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool { return c.PprofAddr == "" }},
		{"consumer state in memory by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool { return !c.BusConsumerFileState }},
		{"consumer file state for an upgrade", []string{"--single-node", "--bus-consumer-file-state"}, nil, true, func(c serveConfig) bool { return c.BusConsumerFileState }},
		{"consumer file state from the environment", []string{"--single-node"}, map[string]string{"KVROUTER_BUS_CONSUMER_FILE_STATE": "true"}, true,
			func(c serveConfig) bool { return c.BusConsumerFileState }},
		{"pprof off loopback refused", []string{"--single-node", "--pprof-addr", "0.0.0.0:6060"}, nil, false, nil},
		{"pprof without a port refused", []string{"--single-node", "--pprof-addr", "localhost"}, nil, false, nil},
		{"no events means approximate", []string{"--single-node", "--no-router-kv-events"}, nil, true, func(c serveConfig) bool { return c.Router.Mode == router.ModeKVApprox }},
		{"dynamo env names", []string{"--single-node"}, map[string]string{"DYN_ROUTER_MODE": "round_robin", "DYN_KV_OVERLAP_SCORE_WEIGHT": "1.5",
			"DYN_KV_CACHE_BLOCK_SIZE": "64", "DYN_KV_EVENTS": "false", "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD": "500"}, true,
			func(c serveConfig) bool {
				// round-robin reads no prefill scale and no KV events: both warn and change nothing (dynamo.go)
				return c.Router.Mode == router.ModeRoundRobin && c.Router.PrefillLoadScale == 1 && c.Router.BlockSize == 64 && *c.Router.Thresholds.ActivePrefillTokens == 500 &&
					len(c.Warnings) == 3
			}},
		{"flag beats env", []string{"--single-node", "--router-temperature", "0.2"}, map[string]string{"DYN_ROUTER_TEMPERATURE": "0.9"}, true,
			func(c serveConfig) bool { return c.Router.Temperature == 0.2 }},
		{"peers", []string{"--peers", "r1=127.0.0.1:7001,r2=127.0.0.1:7002"}, nil, true, func(c serveConfig) bool { return len(c.Peers) == 2 && c.Peers[1].RaftAddr == "127.0.0.1:7002" }},
		{"raft groups", []string{"--single-node", "--raft-groups", "4"}, nil, true, func(c serveConfig) bool { return c.RaftGroups == 4 && c.RaftGroupPortStep == 100 }},
		{"raft groups 0", []string{"--single-node", "--raft-groups", "0"}, nil, false, nil},
		{"raft groups over the cap", []string{"--single-node", "--raft-groups", "17"}, nil, false, nil},
		{"raft group ports past 65535", []string{"--single-node", "--raft-groups", "8", "--raft-group-port-step", "2000"}, nil, false, nil},
		{"pooled wait weight", []string{"--single-node", "--router-mode", "kv-pooled", "--pooled-wait-weight", "0.1"}, nil, true, func(c serveConfig) bool {
			return c.Router.Pooled.WaitWeight != nil && *c.Router.Pooled.WaitWeight == 0.1
		}},
		{"negative pooled wait weight", []string{"--single-node", "--pooled-wait-weight", "-1"}, nil, false, nil},
		{"inference pool", []string{"--single-node", "--inference-pool", "serving/llama", "--kubeconfig", "/etc/kube/config"}, nil, true, func(c serveConfig) bool {
			return c.InferencePool.Namespace == "serving" && c.InferencePool.Name == "llama" && c.Kubeconfig == "/etc/kube/config"
		}},
		{"inference pool from env", []string{"--single-node"}, map[string]string{"KVROUTER_INFERENCE_POOL": "serving/llama"}, true, func(c serveConfig) bool {
			return c.InferencePool.String() == "serving/llama" && c.Kubeconfig == ""
		}},
		{"inference pool without namespace", []string{"--single-node", "--inference-pool", "llama"}, nil, false, nil},
		{"inference pool bad namespace", []string{"--single-node", "--inference-pool", "Serving/llama"}, nil, false, nil},
		{"tenant engine priority", []string{"--single-node", "--tenant-from", "header", "--tenant-engine-priority"}, nil, true,
			func(c serveConfig) bool { return c.Tenants.EnginePriority }},
		{"tenant engine priority from env", []string{"--single-node", "--tenant-from", "api-key"}, map[string]string{"KVROUTER_TENANT_ENGINE_PRIORITY": "true"}, true,
			func(c serveConfig) bool { return c.Tenants.EnginePriority }},
		{"tenant engine priority without tenants", []string{"--single-node", "--tenant-engine-priority"}, nil, false, nil},
		{"tenant latency guard", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5", "--tenant-latency-guard", "1.5"}, nil, true,
			func(c serveConfig) bool { return c.Tenants.LatencyGuard == 1.5 && c.Router.LearnLatency }},
		{"tenant latency guard from env", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5"}, map[string]string{"KVROUTER_TENANT_LATENCY_GUARD": "2"}, true,
			func(c serveConfig) bool { return c.Tenants.LatencyGuard == 2 && c.Router.LearnLatency }},
		{"tenant latency guard off by default", []string{"--single-node", "--tenant-from", "header"}, nil, true,
			func(c serveConfig) bool { return c.Tenants.LatencyGuard == 0 && !c.Router.LearnLatency }},
		{"tenant latency guard below 1", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5", "--tenant-latency-guard", "0.5"}, nil, false, nil},
		{"tenant latency guard NaN", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5", "--tenant-latency-guard", "NaN"}, nil, false, nil},
		{"tenant latency guard without tenants", []string{"--single-node", "--router-queue-threshold", "0.5", "--tenant-latency-guard", "2"}, nil, false, nil},
		{"tenant latency guard without a queue", []string{"--single-node", "--tenant-from", "header", "--tenant-latency-guard", "2"}, nil, false, nil},
		{"tenant isolation", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5", "--tenant-isolation", "1.5"}, nil, true,
			func(c serveConfig) bool { return c.Tenants.Isolation == 1.5 }},
		{"tenant isolation from env", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5"}, map[string]string{"KVROUTER_TENANT_ISOLATION": "2"}, true,
			func(c serveConfig) bool { return c.Tenants.Isolation == 2 }},
		{"tenant isolation off by default", []string{"--single-node", "--tenant-from", "header"}, nil, true,
			func(c serveConfig) bool { return c.Tenants.Isolation == 0 }},
		{"tenant isolation below 1", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5", "--tenant-isolation", "0.5"}, nil, false, nil},
		{"tenant isolation NaN", []string{"--single-node", "--tenant-from", "header", "--router-queue-threshold", "0.5", "--tenant-isolation", "NaN"}, nil, false, nil},
		{"tenant isolation without tenants", []string{"--single-node", "--router-queue-threshold", "0.5", "--tenant-isolation", "2"}, nil, false, nil},
		{"tenant isolation without a queue", []string{"--single-node", "--tenant-from", "header", "--tenant-isolation", "2"}, nil, false, nil},
		{"shadow warm-up off by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool { return !c.WarmUpShadow && c.ShadowInflight == 8 }},
		{"shadow warm-up", []string{"--single-node", "--router-warmup-shadow", "--router-shadow-inflight", "3"}, nil, true, func(c serveConfig) bool { return c.WarmUpShadow && c.ShadowInflight == 3 }},
		{"shadow warm-up from env", []string{"--single-node"}, map[string]string{"KVROUTER_ROUTER_WARMUP_SHADOW": "true"}, true, func(c serveConfig) bool { return c.WarmUpShadow }},
		{"shadow inflight 0", []string{"--single-node", "--router-shadow-inflight", "0"}, nil, false, nil},
		{"drain shadow off by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool { return !c.DrainShadow && c.SessionBodiesMaxBytes == 64<<20 }},
		{"drain shadow", []string{"--single-node", "--router-drain-shadow", "--router-session-bodies-max-bytes", "2097152"}, nil, true, func(c serveConfig) bool { return c.DrainShadow && c.SessionBodiesMaxBytes == 2<<20 }},
		{"drain shadow from env", []string{"--single-node"}, map[string]string{"KVROUTER_ROUTER_DRAIN_SHADOW": "1"}, true, func(c serveConfig) bool { return c.DrainShadow }},
		{"session bodies too small", []string{"--single-node", "--router-session-bodies-max-bytes", "1000"}, nil, false, nil},
		{"no formation", nil, nil, false, nil},
		{"bad peer", []string{"--peers", "r1"}, nil, false, nil},
		{"decode threshold 2", []string{"--single-node", "--active-decode-blocks-threshold", "2"}, nil, false, nil},
		{"NaN temperature", []string{"--single-node", "--router-temperature", "NaN"}, nil, false, nil},
		{"bad mode", []string{"--single-node", "--router-mode", "fastest"}, nil, false, nil},
		{"busy status 500", []string{"--single-node", "--busy-status", "500"}, nil, false, nil},
		{"bad env", []string{"--single-node"}, map[string]string{"DYN_ROUTER_TEMPERATURE": "warm"}, false, nil},
		{"stray argument", []string{"--single-node", "extra"}, nil, false, nil},
		{"disagg off by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool {
			return c.Disagg.Mode == router.DisaggOff && c.Disagg.KV.BytesPerToken() == 114688 && c.Disagg.LinkMBps == 104
		}},
		{"disagg auto", []string{"--single-node", "--disagg", "auto", "--disagg-link-mbps", "1000", "--disagg-model-shape", "32,8,128,2",
			"--disagg-link-max-transfers", "4"}, nil, true, func(c serveConfig) bool {
			dc, err := c.Disagg.RouterConfig()
			return err == nil && c.Disagg.Mode == router.DisaggAuto && dc.KV.BytesPerToken() == 131072 && dc.Topology.Links["link"].MaxConcurrent == 4
		}},
		{"disagg env and measured bytes", []string{"--single-node"}, map[string]string{"KVROUTER_DISAGG": "always", "KVROUTER_DISAGG_KV_BYTES_PER_TOKEN": "70000"}, true,
			func(c serveConfig) bool {
				return c.Disagg.Mode == router.DisaggAlways && c.Disagg.KV.BytesPerToken() == 70000
			}},
		{"metrics compat off by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool { return c.MetricsCompat == "none" }},
		{"metrics compat dynamo from env", []string{"--single-node"}, map[string]string{"KVROUTER_METRICS_COMPAT": "dynamo"}, true,
			func(c serveConfig) bool { return c.MetricsCompat == "dynamo" }},
		{"metrics compat unknown", []string{"--single-node", "--metrics-compat", "vllm"}, nil, false, nil},
		{"entry cap 4 MiB by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool { return c.MaxEntryBytes == 4<<20 }},
		{"entry cap from env", []string{"--single-node"}, map[string]string{"KVROUTER_MAX_ENTRY_BYTES": "1048576"}, true,
			func(c serveConfig) bool { return c.MaxEntryBytes == 1<<20 }},
		{"entry cap below one event", []string{"--single-node", "--max-entry-bytes", "65536"}, nil, false, nil},
		{"entry cap near the state machine's", []string{"--single-node", "--max-entry-bytes", "100000000"}, nil, false, nil},
		{"disagg bad mode", []string{"--single-node", "--disagg", "sometimes"}, nil, false, nil},
		{"disagg zero link", []string{"--single-node", "--disagg", "always", "--disagg-link-mbps", "0"}, nil, false, nil},
		{"disagg bad shape", []string{"--single-node", "--disagg", "auto", "--disagg-model-shape", "28,8"}, nil, false, nil},
		{"disagg unknown profile", []string{"--single-node", "--disagg", "auto", "--disagg-profile", "h100"}, nil, false, nil},
		{"endpoint picker off by default", []string{"--single-node"}, nil, true, func(c serveConfig) bool {
			return c.ExtProcAddr == "" && c.ExtProcFallbacks == 0 && c.ReservationTTL == 0
		}},
		{"endpoint picker on loopback", []string{"--single-node", "--ext-proc-listen", "127.0.0.1:9002", "--ext-proc-fallbacks", "3",
			"--reservation-ttl", "90s"}, nil, true, func(c serveConfig) bool {
			return c.ExtProcAddr == "127.0.0.1:9002" && c.ExtProcFallbacks == 3 && c.ReservationTTL == 90*time.Second
		}},
		{"endpoint picker from env", []string{"--single-node"}, map[string]string{"KVROUTER_EXT_PROC_LISTEN": "127.0.0.1:9002"}, true,
			func(c serveConfig) bool { return c.ExtProcAddr == "127.0.0.1:9002" }},
		{"endpoint picker off loopback without TLS", []string{"--single-node", "--ext-proc-listen", "0.0.0.0:9002"}, nil, false, nil},
		{"too many fallbacks", []string{"--single-node", "--ext-proc-fallbacks", "17"}, nil, false, nil},
	}
	for _, tc := range tests {
		c, err := parseServe(tc.args, env(tc.env), io.Discard)
		if (err == nil) != tc.ok {
			t.Errorf("%s: err = %v", tc.name, err)
			continue
		}
		if tc.check != nil && !tc.check(c) {
			t.Errorf("%s: config %+v", tc.name, c)
		}
	}
}

// --workers keeps reading the old id=URL form (no capacity) and reads a
// capacity after ';' by the registration API's names; anything else after
// ';' is an error, not a silently ignored suffix.
func TestParseStaticWorkers(t *testing.T) {
	tests := []struct {
		in   string
		want []replica.StaticWorker // nil with ok false: an error
		ok   bool
	}{
		{"w0=http://127.0.0.1:9000", []replica.StaticWorker{{ID: "w0", URL: "http://127.0.0.1:9000"}}, true},
		{"w0=http://a:1/, w1=https://b:2", []replica.StaticWorker{{ID: "w0", URL: "http://a:1"}, {ID: "w1", URL: "https://b:2"}}, true},
		{"w0=http://a:1;total_kv_blocks=2048;max_num_batched_tokens=8192",
			[]replica.StaticWorker{{ID: "w0", URL: "http://a:1", TotalBlocks: 2048, MaxBatchedTokens: 8192}}, true},
		{"w0=http://a:1;max_num_batched_tokens=4096,w1=http://b:2",
			[]replica.StaticWorker{{ID: "w0", URL: "http://a:1", MaxBatchedTokens: 4096}, {ID: "w1", URL: "http://b:2"}}, true},
		{"w0=http://a:1;total_kv_blocks=0", nil, false},
		{"w0=http://a:1;total_kv_blocks=-5", nil, false},
		{"w0=http://a:1;blocks=2048", nil, false},
		{"w0=http://a:1;total_kv_blocks", nil, false},
		{"w0=http://a:1;", nil, false},
		{"w0", nil, false},
		{"=http://a:1", nil, false},
		{"w0=a:1;total_kv_blocks=8", nil, false},
	}
	for _, tc := range tests {
		got, err := parseStatic(tc.in)
		if (err == nil) != tc.ok {
			t.Errorf("%q: err = %v, want ok %v", tc.in, err, tc.ok)
			continue
		}
		if tc.ok && !slices.Equal(got, tc.want) {
			t.Errorf("%q: %+v, want %+v", tc.in, got, tc.want)
		}
	}
}

// --workers-file is a static pool: one --workers entry per line, joined to
// --workers' whichever flag comes first; a worker in both, a line with two
// workers, a bad entry (named by its line) or a missing file is an error.
func TestServeWorkersFile(t *testing.T) {
	dir := t.TempDir()
	file := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	pool := file("pool", "# the gateway's pool\nw1=http://10.0.0.1:8000;total_kv_blocks=4096\n\n  w2=http://10.0.0.2:8000  \n")
	none := func(string) string { return "" }
	for _, args := range [][]string{
		{"--single-node", "--workers", "w0=http://10.0.0.9:8000", "--workers-file", pool},
		{"--single-node", "--workers-file", pool, "--workers", "w0=http://10.0.0.9:8000"},
	} {
		c, err := parseServe(args, none, io.Discard)
		if err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		var got []string
		for _, w := range c.StaticWorkers {
			got = append(got, fmt.Sprintf("%s=%s/%d", w.ID, w.URL, w.TotalBlocks))
		}
		if want := "w0=http://10.0.0.9:8000/0 w1=http://10.0.0.1:8000/4096 w2=http://10.0.0.2:8000/0"; strings.Join(got, " ") != want {
			t.Fatalf("%v: workers %v, want %s", args, got, want)
		}
	}
	for name, args := range map[string][]string{
		"in both":       {"--workers", "w1=http://10.0.0.9:8000", "--workers-file", pool},
		"twice in file": {"--workers-file", file("twice", "w1=http://a:1\nw1=http://b:1\n")},
		"two per line":  {"--workers-file", file("commas", "w1=http://a:1,w2=http://b:1\n")},
		"bad entry":     {"--workers-file", file("bad", "w1=http://a:1\nw2\n")},
		"missing file":  {"--workers-file", filepath.Join(dir, "nope")},
	} {
		_, err := parseServe(append([]string{"--single-node"}, args...), none, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "--workers-file") {
			t.Errorf("%s: err = %v, want a --workers-file error", name, err)
		}
	}
}
