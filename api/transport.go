package api

import (
	"bytes"
	"net"
	"net/http"
	"time"
)

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// newWorkerClient is the client to the workers: a short dial timeout so a
// dead worker is retried elsewhere quickly, no overall timeout (generations
// stream for minutes), idle connections kept for the next request.
func newWorkerClient(connect time.Duration) *http.Client {
	d := &net.Dialer{Timeout: connect, KeepAlive: 30 * time.Second}
	return &http.Client{Transport: &http.Transport{
		DialContext:           d.DialContext,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: 0,
		DisableCompression:    true, // relay bytes exactly as the worker sent them
	}}
}
