package replica

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func TestTokenizerAgreementCompare(t *testing.T) {
	own := modelPrints{"a": "f1", "b": "f2", "c": "none"}
	cases := []struct {
		name string
		peer modelPrints
		want map[string]string
	}{
		{"same files", modelPrints{"a": "f1", "b": "f2", "c": "none"}, map[string]string{"a": "ok", "b": "ok", "c": "ok"}},
		{"one template differs", modelPrints{"a": "f1", "b": "f9"}, map[string]string{"a": "ok", "b": "differs: here f2, there f9"}},
		{"files here, none there", modelPrints{"a": "none"}, map[string]string{"a": "differs: here f1, there none"}},
		{"peer knows other models", modelPrints{"z": "f1"}, map[string]string{}},
	}
	for _, c := range cases {
		if got := compare(own, c.peer); !maps.Equal(got, c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// A peer whose status shows another fingerprint raises the gauge and shows
// in the report; agreement lowers it again.
func TestTokenizerAgreementCheck(t *testing.T) {
	peerPrint := "f9"
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]any{"tokenizers": []map[string]any{{"model": "a", "fingerprint": peerPrint}}})
	}))
	defer peer.Close()
	reg := prometheus.NewRegistry()
	a := newTokenizerAgreement("r1", reg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	a.check(context.Background(), modelPrints{"a": "f1"}, "r2", peer.URL)
	if v := gaugeValue(t, a, "a", "r2"); v != 1 {
		t.Fatalf("gauge %v after a mismatch", v)
	}
	if got := a.snapshot()["r2"]["a"]; got != "differs: here f1, there f9" {
		t.Fatalf("report %q", got)
	}
	peerPrint = "f1"
	a.check(context.Background(), modelPrints{"a": "f1"}, "r2", peer.URL)
	if v := gaugeValue(t, a, "a", "r2"); v != 0 || a.snapshot()["r2"]["a"] != "ok" {
		t.Fatalf("gauge %v, report %v after agreement", v, a.snapshot())
	}
}

func gaugeValue(t *testing.T, a *tokenizerAgreement, model, peer string) float64 {
	t.Helper()
	var m dto.Metric
	if err := a.gauge.WithLabelValues(model, peer).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}
