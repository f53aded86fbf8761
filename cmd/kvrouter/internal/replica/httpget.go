package replica

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/fsm"
)

// httpGet fetches url and hands its body, at most limit bytes, to read:
// the one GET the replica's background checks (LoRA discovery, tokenizer
// agreement) make of workers and peers. bearer, when set, is sent as the
// bearer token (a worker's API key). Any status but 200 is an error.
func httpGet(ctx context.Context, client *http.Client, url, bearer string, limit int64, read func(io.Reader) error) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", req.URL.Path, resp.Status)
	}
	return read(io.LimitReader(resp.Body, limit))
}

// peerStatus reads a peer replica's /cluster/status into dst (JSON),
// without the state digest (a copy of the peer's whole index) unless
// withDigest. base is the peer's advertised HTTP address.
func peerStatus(ctx context.Context, client *http.Client, base string, withDigest bool, dst any) error {
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	url := strings.TrimRight(base, "/") + "/cluster/status"
	if !withDigest {
		url += "?digest=0"
	}
	if err := httpGet(ctx, client, url, "", 16<<20, func(r io.Reader) error { return json.NewDecoder(r).Decode(dst) }); err != nil {
		return fmt.Errorf("peer status: %w", err)
	}
	return nil
}

// everyPeer calls check for each other replica with an HTTP address, in
// rounds about every apart (jittered between every/2 and 3·every/2, so
// replicas started together do not poll in step), until ctx ends.
func everyPeer(ctx context.Context, every time.Duration, self string, nodes func() []fsm.NodeRecord, check func(ctx context.Context, id, addr string)) {
	for {
		t := time.NewTimer(every/2 + rand.N(every))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		for _, n := range nodes() {
			if n.ID != self && n.HTTPAddr != "" {
				check(ctx, n.ID, n.HTTPAddr)
			}
		}
	}
}
