package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/router"
)

func TestTuneSplitArgs(t *testing.T) {
	tune, rest, err := splitTuneArgs([]string{"--workers", "4", "--scales", "1,2", "-top=3", "--trace", "a.jsonl", "--current=kv-pooled"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(rest, []string{"--workers", "4", "--trace", "a.jsonl"}) || tune["scales"] != "1,2" || tune["top"] != "3" || tune["current"] != "kv-pooled" {
		t.Fatalf("tune %v, rest %v", tune, rest)
	}
	if _, _, err := splitTuneArgs([]string{"--scales"}); err == nil {
		t.Fatal("a tune flag without its value accepted")
	}
}

func TestTuneParse(t *testing.T) {
	bad := []map[string]string{
		{"scales": "1,x"}, {"credits": "1.5"}, {"temperatures": "-1"}, {"decode-thresholds": "0.5,2"},
		{"prefill-thresholds": "x"}, {"objective": "ttft"}, {"max-ttft-ratio": "0.5"}, {"top": "0"}, {"current": "policy=nope"}, {"current": "speed=3"},
	}
	for _, f := range bad {
		if _, err := parseTune(f); err == nil {
			t.Errorf("%v accepted", f)
		}
	}
	o, err := parseTune(map[string]string{"current": "policy=kv-pooled,scale=2,decode-threshold=0.9,prefill-threshold=1.5", "decode-thresholds": "none,0.8"})
	if err != nil {
		t.Fatal(err)
	}
	c := o.Current
	if c.Policy != router.ModeKVPooled || c.Scale != 2 || c.DecodeThreshold == nil || *c.DecodeThreshold != 0.9 || c.PrefillThreshold == nil || *c.PrefillThreshold != 1.5 {
		t.Fatalf("current %+v", c)
	}
	if len(o.Thresholds) != 2 || o.Thresholds[0] != nil || *o.Thresholds[1] != 0.8 {
		t.Fatalf("thresholds %v", o.Thresholds)
	}
}

// The grid varies the knobs only for cache-aware policies, holds the
// current setting once and first.
func TestTuneGrid(t *testing.T) {
	o, err := parseTune(map[string]string{"scales": "1,4", "temperatures": "0,0.5"})
	if err != nil {
		t.Fatal(err)
	}
	g := o.grid([]router.Mode{router.ModeKV, router.ModeRoundRobin})
	if len(g) != 5 || g[0].String() != o.Current.String() {
		t.Fatalf("grid %v", g)
	}
	seen := map[string]bool{}
	for _, s := range g {
		if seen[s.String()] {
			t.Fatalf("%s twice", s)
		}
		seen[s.String()] = true
	}
}

func TestTuneApplyLines(t *testing.T) {
	cur := tuneSetting{Policy: router.ModeKV, Scale: 1, Credit: 1}
	thr, two := 0.9, 2.0
	cases := []struct {
		best tuneSetting
		want []string
	}{
		{cur, nil},
		{tuneSetting{Policy: router.ModeKVPooled, Scale: 1, Credit: 1}, []string{"--router-mode kv-pooled"}},
		{tuneSetting{Policy: router.ModeKV, Scale: 4, Credit: 0.5, Temperature: 0.2}, []string{"--router-prefill-load-scale 4 --router-kv-overlap-score-credit 0.5 --router-temperature 0.2"}},
		{tuneSetting{Policy: router.ModeKV, Scale: 1, Credit: 1, DecodeThreshold: &thr}, []string{`"active_decode_blocks_threshold":0.9,"model":"m"`}},
		{tuneSetting{Policy: router.ModeKV, Scale: 1, Credit: 1, PrefillThreshold: &two}, []string{`{"active_prefill_tokens_threshold_frac":2,"model":"m"}`}},
	}
	// Turning a threshold off clears it.
	withThr := cur
	withThr.DecodeThreshold = &thr
	if got := applyLines(withThr, cur, "m"); len(got) != 1 || !strings.Contains(got[0], `"clear":["active_decode_blocks_threshold"]`) {
		t.Errorf("clearing: %q", got)
	}
	for _, c := range cases {
		got := applyLines(cur, c.best, "m")
		if len(got) != len(c.want) {
			t.Errorf("%s: %q", c.best, got)
			continue
		}
		for i := range got {
			if !strings.Contains(got[i], c.want[i]) {
				t.Errorf("%s: %q, want it to contain %q", c.best, got[i], c.want[i])
			}
		}
	}
}

// On seed 002's shape kv-pooled beats kv, and tune says so and how.
func TestTuneRun(t *testing.T) {
	var out, errb bytes.Buffer
	js := filepath.Join(t.TempDir(), "tune.json")
	code := runTune([]string{"--workers", "4", "--kv-blocks", "2048", "--requests", "200", "--prefixes", "48", "--concurrency", "8",
		"--scales", "1", "--reps", "1", "--json", js}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "best: kv-pooled") || !strings.Contains(out.String(), "apply: kvrouter serve --router-mode kv-pooled") {
		t.Fatalf("output:\n%s", out.String())
	}
	data, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Results []tuneResult `json:"results"`
	}
	if err := json.Unmarshal(data, &doc); err != nil || len(doc.Results) != 2 || doc.Results[0].Setting.Policy != router.ModeKV {
		t.Fatalf("json: %v %+v", err, doc)
	}
	if doc.Results[1].Result.CachedTokenRatio <= doc.Results[0].Result.CachedTokenRatio {
		t.Fatalf("kv-pooled %.3f not above kv %.3f", doc.Results[1].Result.CachedTokenRatio, doc.Results[0].Result.CachedTokenRatio)
	}
	if code := runTune([]string{"--objective", "speed"}, &out, &errb); code != 2 {
		t.Fatalf("bad objective: exit %d", code)
	}
}
