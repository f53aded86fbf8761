package figures

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFiguresUsersFeel(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("g-s002-ttft.json", `{"config":{"workers":6,"kv_blocks":[585,585,585,585,585,585],"requests":1200,
	  "synthetic":{"prefixes":24,"output_tokens":64},"slo":{"ttft_ms":500,"tpot_ms":0},"attainment_target":0.9},
	  "results":[{"policy":"round-robin","goodput_rps":4},{"policy":"gaie","goodput_rps":6},
	  {"policy":"kv","goodput_rps":5},{"policy":"kv-pooled","goodput_rps":1000,"capped":true}]}`)
	write("r-s002.json", `{"config":{"workers":6,"kv_blocks":[585,585,585,585,585,585],"requests":1200,
	  "synthetic":{"prefixes":24,"output_tokens":64,"arrival_rate":8}},
	  "results":[{"policy":"round-robin","ttft_ms":{"p50":90,"p99":300}},{"policy":"gaie","ttft_ms":{"p50":80,"p99":250}},
	  {"policy":"kv","ttft_ms":{"p50":70,"p99":200}},{"policy":"kv-pooled","ttft_ms":{"p50":60,"p99":150}}]}`)
	got, err := formatUsersFeel(Output{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| 24 prefixes, 64-token outputs, 6 × 585 blocks | TTFT ≤ 500 ms | 4 | 6 (1.50 ×) | 5 (1.25 ×) | ≥ 1e+03 (250.00 ×) |",
		"| 24 prefixes, 64-token outputs, 6 × 585 blocks | 8 req/s | 90 / 300 | 80 / 250 | 70 / 200 | 60 / 150 |",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("table lacks %q:\n%s", want, got)
		}
	}
	os.Remove(filepath.Join(dir, "g-s002-ttft.json"))
	if _, err := formatUsersFeel(Output{Dir: dir}); err == nil {
		t.Fatal("no goodput report, no error")
	}
}
