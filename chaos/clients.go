//go:build chaos

package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"
)

// --- route clients -------------------------------------------------------------

// routeStats counts route requests through HAProxy: each request is tried
// once and, if that fails, retried once after retryDelay.
type routeStats struct {
	mu       sync.Mutex
	total    int
	okFirst  int
	okRetry  int
	failed   int
	errs     map[string]int
	failures []routeFailure // first attempt failures, for the timeline
}

type routeFailure struct {
	At      time.Time `json:"at"`
	Err     string    `json:"err"`
	Retried bool      `json:"retry_ok"`
}

const (
	routeTimeout = 4 * time.Second
	retryDelay   = 500 * time.Millisecond
)

func newRouteStats() *routeStats { return &routeStats{errs: map[string]int{}} }

// routeClient sends chat completions through HAProxy until ctx ends. With
// TLS the replica behind HAProxy answers the handshake (HAProxy passes TCP
// through), so the client checks for the cluster's service name.
func routeClient(ctx context.Context, n int, acc *access, st *routeStats, pace time.Duration) {
	client := acc.client(routeTimeout, serviceName)
	t := client.Transport.(*http.Transport)
	t.MaxIdleConnsPerHost, t.IdleConnTimeout = 2, 30*time.Second
	url := acc.lbURL() + "/v1/chat/completions"
	rng := rand.New(rand.NewPCG(uint64(n), 7))
	for i := 0; ctx.Err() == nil; i++ {
		// A few shared prefixes so KV routing has something to do.
		prompt := fmt.Sprintf("chaos prefix %d: %s / client %d request %d", rng.IntN(8), strings.Repeat("lorem ipsum dolor ", 8), n, i)
		body, _ := json.Marshal(map[string]any{"model": routeModel, "max_tokens": 4,
			"messages": []map[string]string{{"role": "user", "content": prompt}}})
		at := time.Now()
		err := routeOnce(ctx, client, url, body)
		if ctx.Err() != nil {
			return // the run ended mid-request: not counted
		}
		retried := false
		if err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(retryDelay):
			}
			retried = routeOnce(ctx, client, url, body) == nil
			if ctx.Err() != nil {
				return
			}
		}
		st.mu.Lock()
		st.total++
		switch {
		case err == nil:
			st.okFirst++
		case retried:
			st.okRetry++
		default:
			st.failed++
		}
		if err != nil {
			st.errs[shortErr(err)]++
			if len(st.failures) < 5000 {
				st.failures = append(st.failures, routeFailure{At: at, Err: err.Error(), Retried: retried})
			}
		}
		st.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-time.After(pace):
		}
	}
}

func routeOnce(ctx context.Context, client *http.Client, url string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("reading body: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, firstLine(data))
	}
	var out struct {
		Choices []json.RawMessage `json:"choices"`
	}
	if err := json.Unmarshal(data, &out); err != nil || len(out.Choices) == 0 {
		return fmt.Errorf("bad completion body: %s", firstLine(data))
	}
	return nil
}

func firstLine(b []byte) string {
	s := strings.TrimSpace(string(b))
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > 160 {
		s = s[:160]
	}
	return s
}

// shortErr groups errors for the summary (no addresses, ports or ids).
func shortErr(err error) string {
	s := err.Error()
	switch {
	case strings.Contains(s, "connection reset"):
		return "connection reset"
	case strings.Contains(s, "connection refused"):
		return "connection refused"
	case strings.Contains(s, "EOF"):
		return "EOF"
	case strings.Contains(s, "Timeout") || strings.Contains(s, "deadline"):
		return "timeout"
	case strings.HasPrefix(s, "HTTP "):
		if len(s) > 60 {
			s = s[:60]
		}
		return s
	}
	if len(s) > 60 {
		s = s[:60]
	}
	return s
}

func (st *routeStats) snapshot() (total, okFirst, okRetry, failed int, errs map[string]int) {
	st.mu.Lock()
	defer st.mu.Unlock()
	errs = map[string]int{}
	for k, v := range st.errs {
		errs[k] = v
	}
	return st.total, st.okFirst, st.okRetry, st.failed, errs
}

// --- admin clients ---------------------------------------------------------------------

// adminClient alternates writes and reads against the replicas (a random
// one each time, whatever its state) until ctx ends. Each client writes
// its own values: client c writes c*1e5+1, c*1e5+2, …
func adminClient(ctx context.Context, c int, acc *access, urls func() []replicaRef, h *adminHistory, pace time.Duration) {
	rng := rand.New(rand.NewPCG(uint64(c), 11))
	seq := int64(0)
	for ctx.Err() == nil {
		refs := urls()
		ref := refs[rng.IntN(len(refs))]
		write := rng.IntN(2) == 0
		op := adminOp{Client: c, Replica: ref.id, Write: write}
		var err error
		call := time.Now()
		if write {
			seq++
			op.Value = int64(c)*100000 + seq
			err = adminWrite(ctx, acc, ref.url, op.Value)
		} else {
			op.Value, err = adminRead(ctx, acc, ref.url)
		}
		ret := time.Now()
		if ctx.Err() != nil && err != nil {
			// Cancelled by the end of the run: a write's outcome is unknown.
			if write {
				op.Call, op.Return, op.Err = h.since(call), math.MaxInt64, "cancelled"
				h.add(op)
			}
			return
		}
		op.Call, op.Return, op.OK = h.since(call), h.since(ret), err == nil
		if err != nil {
			op.Err = err.Error()
		}
		h.add(op)
		wait := pace
		if err != nil {
			wait = 3 * pace
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait/2 + rand.N(wait)):
		}
	}
}

type replicaRef struct{ id, url string }

func adminWrite(ctx context.Context, acc *access, base string, v int64) error {
	return postThreshold(ctx, acc, base, fmt.Sprintf(`{"model":%q,"active_decode_blocks_threshold":%s}`, ledgerModel, valueJSON(v)))
}

// postThreshold POSTs body to base's /busy_threshold; anything but 200 is
// an error carrying the answer's first line.
func postThreshold(ctx context.Context, acc *access, base, body string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/busy_threshold", strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := acc.adminDo(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, firstLine(data))
	}
	return nil
}

func valueJSON(v int64) string { return fmt.Sprintf("%.6f", float64(v)/1e6) }

func adminRead(ctx context.Context, acc *access, base string) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/busy_threshold", nil)
	if err != nil {
		return 0, err
	}
	resp, err := acc.adminDo(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("HTTP %d: %s", resp.StatusCode, firstLine(data))
	}
	var out struct {
		Thresholds []struct {
			Model  string   `json:"model"`
			Decode *float64 `json:"active_decode_blocks_threshold"`
		} `json:"thresholds"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		return 0, err
	}
	for _, t := range out.Thresholds {
		if t.Model == ledgerModel {
			if t.Decode == nil {
				return -1, nil
			}
			return int64(math.Round(*t.Decode * 1e6)), nil
		}
	}
	return 0, fmt.Errorf("model %s missing from %s", ledgerModel, firstLine(data))
}
