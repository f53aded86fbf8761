package report

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
)

func TestReportMeanEvents(t *testing.T) {
	ev := func(worker string, lost float64, warm stats.Optional) sim.EventFigures {
		return sim.EventFigures{Kind: "add", AtS: 60, Worker: worker, LostCachedTokens: lost, WarmS: warm,
			Steady: sim.WindowFigures{Requests: 10, CachedTokenRatio: 0.5}}
	}
	for _, tc := range []struct {
		name     string
		runs     []Run
		want     func(e []EventResult) bool
		wantJSON []string
	}{
		{"no events", []Run{{Summary: sim.Summary{}}}, func(e []EventResult) bool { return e == nil }, nil},
		{"one rep", []Run{{Summary: sim.Summary{Events: []sim.EventFigures{ev("w5", 100, stats.Optional{Value: 10, Valid: true})}}}},
			func(e []EventResult) bool {
				return len(e) == 1 && e[0].LostCachedTokens == 100 && e[0].WarmS.Value == 10 && e[0].Reps == nil && e[0].Have == nil
			}, []string{`"workers":["w5"]`, `"warm_s":10`}},
		{"two reps, one warm", []Run{
			{Summary: sim.Summary{Events: []sim.EventFigures{ev("w5", 100, stats.Optional{Value: 10, Valid: true})}}},
			{Summary: sim.Summary{Events: []sim.EventFigures{ev("w6", 300, stats.Optional{})}}},
		}, func(e []EventResult) bool {
			return len(e) == 1 && e[0].LostCachedTokens == 200 && e[0].WarmS.Value == 10 && e[0].Have["warm_s"] == 1 &&
				len(e[0].Reps) == 2 && e[0].Steady.Requests == 10 && e[0].Steady.CachedTokenRatio == 0.5
		}, []string{`"workers":["w5","w6"]`, `"reps_with":{"warm_s":1}`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := MeanEvents(tc.runs)
			if !tc.want(got) {
				t.Fatalf("%+v", got)
			}
			b, err := json.Marshal(got)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.wantJSON {
				if !strings.Contains(string(b), w) {
					t.Fatalf("JSON %s lacks %s", b, w)
				}
			}
		})
	}
}
