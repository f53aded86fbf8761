package sim

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

func TestDbgShadowWarm(t *testing.T) {
	at := 10 * time.Minute
	for _, v := range []string{"kv", "shadow2", "shadow1", "rr"} {
		sum := 0.0
		for seed := uint64(1); seed <= 3; seed++ {
			w := planWorkload(t, seed)
			mode := router.ModeKV
			if v == "rr" {
				mode = router.ModeRoundRobin
			}
			cfg := config(mode, 3, planBlocks)
			base, _ := Run(w, cfg)
			cfg.Events = []FleetEvent{{At: at, Kind: EventAdd}}
			cfg.ShadowWarmUp = v == "shadow2" || v == "shadow1"
			if v == "shadow2" {
				cfg.Shadow.MinHolders = 2
			}
			res, err := Run(w, cfg)
			if err != nil {
				t.Fatal(err)
			}
			f := MeasureEvents(w, res, base, planDip)[0]
			ws := planDip.Horizon.Seconds()
			if f.WarmS.Valid {
				ws = f.WarmS.Value
			}
			sum += ws
			t.Logf("%s seed %d warm %v shadows %d redirects %d share %.3f maxp99 %.0f steady p99 %.0f after p99 %.0f", v, seed, ws, res.Events[0].Shadows, res.Events[0].ShadowRedirects, f.NewWorkerShare.Value, f.MaxTTFTP99Ms, f.Steady.TTFT.P99, f.After.TTFT.P99)
		}
		t.Logf("%s mean warm %.1f", v, sum/3)
	}
}
