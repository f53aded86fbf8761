package replica

import (
	"context"
	"fmt"
	"io"
	"net/http"
)

// httpGet fetches url and hands its body, at most limit bytes, to read:
// the one GET the replica's background checks (LoRA discovery, tokenizer
// agreement) make of workers and peers. Any status but 200 is an error.
func httpGet(ctx context.Context, client *http.Client, url string, limit int64, read func(io.Reader) error) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
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
